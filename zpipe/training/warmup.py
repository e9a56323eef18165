"""Which 1F1B warm-up counts a run uses: Asteroid's or torch's, and when.

Two rules for K_p, the forwards stage ``p`` of ``P`` runs before its first backward:

- ``"asteroid"``: ``K_p = min(2 (P - p) - 1, M)`` (Asteroid, MobiCom '24, section 3.2;
  :func:`zpipe.planner.schedules.asteroid_warmup`). The deeper warm-up keeps a
  stage busy while activations and gradients are on the wire: with communication
  as long as compute it is the least K_p that never leaves a stage waiting
  (Eco-FL's equation 3 gives the same in that case).
- ``"torch"``: ``K_p = min(P - p, M)``, what ``torch.distributed.pipelining``'s
  ``Schedule1F1B`` runs: enough when transfers are short against compute.

``"auto"`` (the default) is Asteroid's, chosen by measurement. An earlier rule took
torch's counts when two stages share a host's cores (an emulated cluster), on the
reasoning that the extra ``P - p - 1`` forwards cannot overlap a transfer when no core
is idle, and on one measurement of zpipe's 1F1B at 0.92 of Schedule1F1B with Asteroid's
counts and equal with torch's. After the per-message work on the stage data path that
no longer holds: bench/training.py's torch section (4 stages on two shared cores,
BERT-style, 7 alternating runs each) measured Asteroid's counts over torch's at
1.044, 1.032, 0.995 and 0.997 on an idle machine and 1.102, 1.081 at load 5-8: never
more than 0.5 % slower, up to 10 % faster where the cores are contended (a stage that
runs ahead absorbs its neighbours' jitter). The planners already budget memory for
Asteroid's counts (:func:`zpipe.planner.hpp.stage_warmup`), so the deeper warm-up
never holds more activations than a plan allows; ``"torch"`` stays for a user who
wants the shallower counts (less activation memory on the first stages). Synchronous
1F1B computes the same gradients under either count (the optimizer steps once per
mini-batch, after every backward), so the choice changes time and memory only, never
the model.
"""

from __future__ import annotations

from zpipe._errors import ConfigError
from zpipe.planner.schedules import asteroid_warmup, torch_warmup

WARMUP_POLICIES = ("auto", "asteroid", "torch")


def check_warmup_policy(policy: object) -> str:
    """``policy`` if it is one of :data:`WARMUP_POLICIES`, else a ConfigError."""
    if not isinstance(policy, str) or policy not in WARMUP_POLICIES:
        raise ConfigError(f"warmup must be one of {', '.join(WARMUP_POLICIES)}, got {policy!r}")
    return policy


def resolve_warmup_policy(policy: str) -> str:
    """``"asteroid"`` or ``"torch"``: ``"auto"`` is Asteroid's (see the module's docstring)."""
    check_warmup_policy(policy)
    return "asteroid" if policy == "auto" else policy


def warmup_counts(policy: str, num_stages: int, num_microbatches: int) -> list[int]:
    """K_p of every stage under a resolved policy (``"asteroid"`` or ``"torch"``)."""
    rule = {"asteroid": asteroid_warmup, "torch": torch_warmup}.get(policy)
    if rule is None:
        raise ConfigError(f"resolve warmup {policy!r} first: asteroid or torch")
    return [rule(num_stages, p, num_microbatches) for p in range(num_stages)]
