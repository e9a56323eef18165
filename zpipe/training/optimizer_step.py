"""One optimizer update from gradients held apart from the parameters, with less Python.

An asynchronous stage makes one update per mini-batch, and on an emulated slow
device every microsecond of the compute thread's CPU is multiplied by the slowdown
(:func:`zpipe.transport.emulation.emulate_slowdown`). Of torch's fused Adam step on
CPU (24-unit residual MLP, hidden 256, one unit: 0.5-0.7 ms) about 0.45 ms is the
Python around the kernel: the step wrapper's ``record_function`` and hook checks,
the dynamo-disable wrapper, ``_init_group`` rebuilding five lists, the grouping by
device and dtype; and the stage's own ``param.grad = ...`` and ``zero_grad`` around
it. :func:`apply_gradients` calls the same kernel (``torch._fused_adam_`` or
``torch._fused_adamw_``) with the same arguments torch's ``Adam.step`` passes it, so
the weights and the optimizer's state are bit for bit torch's; whenever the
optimizer is anything else (SGD, user code, a hook, a grad scaler, a tensor
learning rate, state not made yet: the first update) it takes torch's own path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

# the group fields torch's fused Adam reads, with the values the direct call supports
_PLAIN_ADAM = {"fused": True, "capturable": False, "differentiable": False}


def apply_gradients(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
) -> None:
    """Update ``params`` (the optimizer's, in its one group's order) with ``grads``,
    as ``param.grad = grad; optimizer.step(); optimizer.zero_grad(set_to_none=True)``
    would; every parameter has a gradient."""
    if not _fused_adam_step(optimizer, params, grads):
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _fused_adam_step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
) -> bool:
    """torch's fused Adam/AdamW kernel on ``params`` when the optimizer is in the plain
    form the direct call reproduces exactly; False (nothing done) otherwise."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    if len(optimizer.param_groups) != 1 or not params:
        return False
    group = optimizer.param_groups[0]
    if any(group.get(key) != value for key, value in _PLAIN_ADAM.items()):
        return False
    lr, (beta1, beta2) = group["lr"], group["betas"]
    if not all(isinstance(v, float | int) for v in (lr, beta1, beta2)):
        return False  # a tensor lr or beta: torch moves it per device first
    # hooks, and a scaler's grad_scale/found_inf, change what step does
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return False
    if _global_optimizer_pre_hooks or _global_optimizer_post_hooks:
        return False
    if getattr(optimizer, "grad_scale", None) is not None:
        return False
    if getattr(optimizer, "found_inf", None) is not None:
        return False
    grouped = group["params"]
    if len(grouped) != len(params) or any(a is not b for a, b in zip(grouped, params, strict=True)):
        return False
    first = params[0]
    amsgrad = bool(group["amsgrad"])
    exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], []
    for param, grad in zip(params, grads, strict=True):
        state = optimizer.state.get(param)
        if not state or "exp_avg" not in state:
            return False  # the first update makes the state: torch's own path
        if param.device != first.device or param.dtype != first.dtype or param.is_complex():
            return False  # torch groups these (or views them as real) before the kernel
        if grad.device != param.device or grad.dtype != param.dtype or grad.is_sparse:
            return False
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        if amsgrad:
            max_exp_avg_sqs.append(state["max_exp_avg_sq"])
        steps.append(state["step"])
    kernel = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
    with torch.no_grad():
        # as torch.optim.adam._fused_adam: the step count first, then the kernel
        torch._foreach_add_(steps, 1)
        kernel(
            list(params),
            list(grads),
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            steps,
            amsgrad=amsgrad,
            lr=float(lr),
            beta1=float(beta1),
            beta2=float(beta2),
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            grad_scale=None,
            found_inf=None,
        )
    return True
