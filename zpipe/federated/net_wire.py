"""What fl-server and fl-client share: weights as raw float64 frames, and the socket's keys.

Weights cross as one flat float64 tensor (a raw frame the codec carries
without copying); whatever a peer sends is checked here before any numpy
code sees it, and a misfit raises :class:`ProtocolError`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from zpipe._errors import ProtocolError
from zpipe.federated.model import MLPShape

FloatArray = npt.NDArray[np.float64]

SERVER_KEY_NAME = "fl-server"
CLIENT_KEY_NAME = "fl-client"
MAX_HIDDEN = 4096  # a peer-chosen layer width must not allocate gigabytes


def weights_tensor(weights: FloatArray) -> torch.Tensor:
    """The flat weights as a tensor that shares their memory (sent zero-copy)."""
    return torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float64))


def weights_from(tensors: Sequence[torch.Tensor], size: int, *, what: str) -> FloatArray:
    """The one flat float64 tensor of ``size`` finite values a message must carry."""
    if len(tensors) != 1:
        raise ProtocolError(f"{what}: expected one weights tensor, got {len(tensors)}")
    tensor = tensors[0]
    if tensor.dtype != torch.float64 or tensor.dim() != 1 or tensor.numel() != size:
        raise ProtocolError(
            f"{what}: expected float64 weights of shape ({size},), "
            f"got {tensor.dtype} of shape {tuple(tensor.shape)}"
        )
    weights = tensor.numpy().copy()  # the frame's buffer is not ours to keep
    if not np.all(np.isfinite(weights)):
        raise ProtocolError(f"{what}: non-finite weights")
    return weights


def shape_from(values: Sequence[object]) -> MLPShape:
    """An :class:`MLPShape` from a task's [inputs, hidden, outputs]."""
    if len(values) != 3 or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_HIDDEN for v in values
    ):
        raise ProtocolError(f"model shape must be 3 integers in 1..{MAX_HIDDEN}, got {values!r}")
    n_in, n_hidden, n_out = (int(v) for v in values)  # type: ignore[call-overload]
    return MLPShape(n_in, n_hidden, n_out)
