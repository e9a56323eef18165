"""The untyped message every layer hands to the codec: a kind, an epoch, a body, tensors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch  # annotations only: the protocol imports no torch


# The default of ``body``: a fresh empty dict per message, as ``default_factory=dict``
# gave (a caller's explicit None stays None, and the codec refuses it).
_NO_BODY: Any = object()


@dataclass(frozen=True, init=False)
class Message:
    """One validated message: a kind, the plan epoch it belongs to, a body and tensors.

    The typed classes of :mod:`zpipe.protocol` build one with ``to_message()``
    and read one with ``from_message()``; the codec frames it.
    """

    kind: str
    body: Mapping[str, Any] = field(default_factory=dict)
    epoch: int = 0
    tensors: tuple[torch.Tensor, ...] = ()

    def __init__(
        self,
        kind: str,
        body: Mapping[str, Any] = _NO_BODY,
        epoch: int = 0,
        tensors: tuple[torch.Tensor, ...] = (),
    ) -> None:
        # One update of the instance's dict: the generated __init__ of a frozen
        # dataclass calls object.__setattr__ once per field, and every message sent
        # and received is built once (a quarter of the bytecodes of building one;
        # bench/_transport_counts.py --opcodes). Still frozen: __setattr__ refuses.
        self.__dict__.update(
            kind=kind, body={} if body is _NO_BODY else body, epoch=epoch, tensors=tensors
        )
