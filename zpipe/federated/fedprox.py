"""FedProx's local optimizer for a pipeline client: SGD pulled towards the received model.

FedProx (Eco-FL's h_c^g, section 5.1) trains a client's model on
``loss + mu/2 ||w - w_received||^2``. The numpy trainer adds the term's
gradient ``mu (w - w_received)`` before each SGD step
(:func:`zpipe.federated.model.local_train`); on a zpipe pipeline every stage
builds its own optimizer over its own parameters, so the same term lives in
the optimizer: :func:`proximal_sgd` remembers each parameter as it was when
the stage built it (the task's weights, loaded from the run's weights file)
and adds ``mu (p - anchor)`` to the accumulated gradient at every step. The
term is elementwise, so per-stage optimizers give exactly the one-model update.

A stage imports this factory only when its operator allows it
(``--allow-factory``, see :mod:`zpipe.models.trust`); the pipeline trainer's own
local cluster does (:data:`FACTORY`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

FACTORY = "zpipe.federated.fedprox:proximal_sgd"


class ProximalSGD(torch.optim.Optimizer):
    """Plain SGD on ``grad + mu * (p - anchor)``, the anchor being ``p`` at construction."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, mu: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"proximal_sgd: lr must be > 0, got {lr}")
        if not mu >= 0:
            raise ValueError(f"proximal_sgd: mu must be >= 0, got {mu}")
        super().__init__(params, {"lr": lr, "mu": mu})
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param]["anchor"] = param.detach().clone()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu = float(group["lr"]), float(group["mu"])
            for param in group["params"]:
                if param.grad is None:
                    continue
                direction = param.grad
                if mu > 0:
                    direction = direction + mu * (param - self.state[param]["anchor"])
                param.add_(direction, alpha=-lr)
        return loss


def proximal_sgd(params: Iterable[torch.nn.Parameter], **fields: Any) -> ProximalSGD:
    """The optimizer factory a run names as ``{"name": FACTORY, "lr": .., "mu": ..}``."""
    unknown = sorted(set(fields) - {"lr", "mu"})
    if unknown:
        raise ValueError(f"proximal_sgd: unknown fields {unknown}; known: lr, mu")
    return ProximalSGD(params, lr=float(fields["lr"]), mu=float(fields.get("mu", 0.0)))


def optimizer_config(lr: float, mu: float) -> dict[str, Any]:
    """The run's optimizer description: FedProx's SGD when mu > 0, else plain SGD."""
    if mu > 0:
        return {"name": FACTORY, "lr": lr, "mu": mu}
    return {"name": "sgd", "lr": lr}
