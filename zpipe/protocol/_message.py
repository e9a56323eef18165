"""The untyped message every layer hands to the codec: a kind, an epoch, a body, tensors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Message:
    """One validated message: a kind, the plan epoch it belongs to, a body and tensors.

    The typed classes of :mod:`zpipe.protocol` build one with ``to_message()``
    and read one with ``from_message()``; the codec frames it.
    """

    kind: str
    body: Mapping[str, Any] = field(default_factory=dict)
    epoch: int = 0
    tensors: tuple[torch.Tensor, ...] = ()
