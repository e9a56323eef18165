"""apply_gradients: torch's fused Adam kernel called directly, bit for bit torch's step."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zpipe.training.objectives import make_optimizer
from zpipe.training.optimizer_step import apply_gradients


def _params(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(8, 5), (5,), (3, 8), (3,)]
    return [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]


def _grads(seed: int, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * seed + step)
    return [torch.randn(p.shape, generator=generator) for p in _params(seed)]


def _torch_step(optimizer: torch.optim.Optimizer, params: list[Any], grads: list[Any]) -> None:
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _build(config: dict[str, Any], params: list[Any]) -> torch.optim.Optimizer:
    if "maximize" in config:
        fields = {k: v for k, v in config.items() if k != "name"}
        return torch.optim.Adam(params, fused=True, **fields)
    return make_optimizer(config, params)


CONFIGS = [
    {"name": "adam", "lr": 3e-4},
    {"name": "adam", "lr": 1e-2, "betas": [0.8, 0.95], "weight_decay": 0.1, "eps": 1e-6},
    {"name": "adam", "lr": 1e-2, "amsgrad": True},
    # not a field a run may set, but torch's: the direct call passes it on
    {"name": "adam", "lr": 1e-2, "maximize": True},
    {"name": "adamw", "lr": 1e-2, "weight_decay": 0.05},
    {"name": "adamw", "lr": 1e-3, "amsgrad": True},
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_direct_fused_adam_equals_torch_step_bit_for_bit(config: dict[str, Any]) -> None:
    ours, theirs = _params(1), _params(1)
    ours_opt, theirs_opt = _build(config, ours), _build(config, theirs)
    for step in range(6):
        grads = _grads(1, step)
        if step == 3:  # a schedule's new rate, read at the next update
            for opt in (ours_opt, theirs_opt):
                opt.param_groups[0]["lr"] *= 0.5
        apply_gradients(ours_opt, ours, [g.clone() for g in grads])
        _torch_step(theirs_opt, theirs, grads)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b)
            assert a.grad is None
            sa, sb = ours_opt.state[a], theirs_opt.state[b]
            assert sorted(sa) == sorted(sb)
            for key in sa:
                assert torch.equal(sa[key], sb[key]), key


def test_after_the_first_update_torch_step_is_not_called(monkeypatch: pytest.MonkeyPatch) -> None:
    params = _params(2)
    optimizer = make_optimizer({"name": "adam", "lr": 1e-3}, params)
    apply_gradients(optimizer, params, _grads(2, 0))  # torch's step makes the state
    calls: list[int] = []
    real_step = torch.optim.Adam.step

    def counting_step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", counting_step)
    before = [p.detach().clone() for p in params]
    apply_gradients(optimizer, params, _grads(2, 1))
    assert calls == []
    assert all(not torch.equal(a, b) for a, b in zip(before, params, strict=True))
    assert int(optimizer.state[params[0]]["step"]) == 2


def test_a_hook_or_a_tensor_rate_takes_torch_own_path() -> None:
    params = _params(3)
    optimizer = make_optimizer({"name": "adam", "lr": 1e-3}, params)
    apply_gradients(optimizer, params, _grads(3, 0))
    seen: list[int] = []
    handle = optimizer.register_step_post_hook(lambda *_: seen.append(1))
    apply_gradients(optimizer, params, _grads(3, 1))
    handle.remove()
    assert seen == [1]  # the hook ran: torch's step did the update
    sgd_params = _params(4)
    sgd = make_optimizer({"name": "sgd", "lr": 0.1, "momentum": 0.9}, sgd_params)
    reference = _params(4)
    reference_opt = make_optimizer({"name": "sgd", "lr": 0.1, "momentum": 0.9}, reference)
    for step in range(3):
        apply_gradients(sgd, sgd_params, _grads(4, step))
        _torch_step(reference_opt, reference, _grads(4, step))
    assert all(torch.equal(a, b) for a, b in zip(sgd_params, reference, strict=True))
