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
from typing import Any

import numpy as np
import torch

from zpipe._errors import ProtocolError
from zpipe.lossy.cnn import CnnSpec
from zpipe.lossy.evaluation import EvalSpec
from zpipe.lossy.linkmodes import WAIT_MODES, WaitMode
from zpipe.lossy.links import Recovery
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.partition import Allocation
from zpipe.protocol import Message
from zpipe.protocol.lossy import LossyPartial


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
        body: dict[str, Any] = {
            "alloc": self.alloc.to_dict(),
            "prr": [[float(v) for v in row] for row in self.prr],
            "seed": self.seed,
            "recovery": {
                "scheme": self.recovery.scheme,
                "copies": self.recovery.copies,
                "max_attempts": self.recovery.max_attempts,
            },
            "lossless": self.lossless,
            "lr": self.lr,
            "n_data": self.n_data,
            "batch": self.batch,
            "mode": self.mode,
            "slot_s": self.slot_s,
            "wait_s": self.wait_s,
        }
        if self.test is not None:
            body["test"] = eval_body(self.test)
        if self.cnn is not None:
            body["cnn"] = self.cnn.to_dict()
        return body

    @classmethod
    def from_body(cls, body: Any) -> RunSpec:
        """The spec a setup message carries; :class:`ProtocolError` if malformed."""
        try:
            alloc = Allocation.from_dict(body["alloc"])
            prr = np.asarray(body["prr"], dtype=np.float64)
            rec = body["recovery"]
            spec = cls(
                alloc=alloc,
                prr=prr,
                seed=_int(body["seed"]),
                recovery=Recovery(
                    rec["scheme"],  # Recovery refuses an unknown scheme
                    _int(rec["copies"]),
                    _int(rec["max_attempts"]),
                ),
                lossless=bool(body["lossless"]),
                lr=float(body["lr"]),
                n_data=_int(body["n_data"]),
                batch=_int(body["batch"]),
                mode=body["mode"],
                slot_s=float(body["slot_s"]),
                wait_s=float(body["wait_s"]),
                test=eval_from_body(body.get("test")),
                cnn=None if body.get("cnn") is None else CnnSpec.from_dict(body["cnn"]),
            )
        except (KeyError, TypeError, ValueError) as exc:  # ConfigError is a ValueError
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


def eval_body(spec: EvalSpec) -> dict[str, int]:
    return {
        "n_test": spec.n_test,
        "batch": spec.batch,
        "repeats": spec.repeats,
        "eval_index": spec.eval_index,
    }


def eval_from_body(body: Any) -> EvalSpec | None:
    """A run's test passes as the wire carries them (KeyError, TypeError or
    ValueError if malformed)."""
    if body is None:
        return None
    return EvalSpec(
        n_test=_int(body["n_test"]),
        batch=_int(body["batch"]),
        repeats=_int(body["repeats"]),
        eval_index=_int(body["eval_index"]),
    )


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


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
) -> Message:
    """A partial's message; ``copy`` (r-TX, ACK) numbers it, ``link_layer`` and
    ``direction`` (ACK) key its acknowledgement's fate."""
    return LossyPartial(
        run=run, data=data, kind=kind, layer=layer, src=src, copy=copy, link_layer=link_layer,
        direction=direction, tensors=(to_tensor(values),),
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
