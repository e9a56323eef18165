"""Which 1F1B warm-up counts a run uses: Asteroid's or torch's, and when.

Two rules for K_p, the forwards stage ``p`` of ``P`` runs before its first backward:

- ``"asteroid"``: ``K_p = min(2 (P - p) - 1, M)`` (Asteroid, MobiCom '24, section 3.2;
  :func:`zpipe.training.schedules.asteroid_warmup`). The deeper warm-up keeps a
  stage busy while activations and gradients are on the wire: with communication
  as long as compute it is the least K_p that never leaves a stage waiting
  (Eco-FL's equation 3 gives the same in that case).
- ``"torch"``: ``K_p = min(P - p, M)``, what ``torch.distributed.pipelining``'s
  ``Schedule1F1B`` runs: enough when transfers are short against compute.

Why ``"auto"`` chooses torch's counts when stages share a host's cores. The extra
``P - p - 1`` forwards only pay when a stage would otherwise sit idle waiting for a
transfer, and their compute can overlap it. Stages that share one machine's cores
(an emulated cluster: every stage process on this host) have loopback links
(milliseconds for megabytes) and no idle core to overlap with: a stage that runs
ahead takes CPU from its neighbours, and holds up to ``2 (P - p) - 1`` micro-batches'
activations instead of ``P - p``. bench/training.py measured zpipe's 1F1B at 0.92 of
Schedule1F1B with Asteroid's counts and equal with torch's on the same split, on two
otherwise idle shared cores (under heavy outside load, load average 15-23, runs went
either way: Asteroid's over torch's 1.35, 0.61, 1.18). Stages on their own devices
have idle cores while they wait on a real link, so ``"auto"`` keeps Asteroid's counts
there. Synchronous 1F1B computes the same
gradients under either count (the optimizer steps once per mini-batch, after every
backward), so the choice changes time and memory only, never the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from zpipe._errors import ConfigError
from zpipe.training.schedules import asteroid_warmup, torch_warmup

WARMUP_POLICIES = ("auto", "asteroid", "torch")
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", "*"})


def check_warmup_policy(policy: object) -> str:
    """``policy`` if it is one of :data:`WARMUP_POLICIES`, else a ConfigError."""
    if not isinstance(policy, str) or policy not in WARMUP_POLICIES:
        raise ConfigError(f"warmup must be one of {', '.join(WARMUP_POLICIES)}, got {policy!r}")
    return policy


def resolve_warmup_policy(policy: str, *, stages_share_cores: bool) -> str:
    """``"asteroid"`` or ``"torch"``: ``"auto"`` is torch's where stages share cores."""
    check_warmup_policy(policy)
    if policy != "auto":
        return policy
    return "torch" if stages_share_cores else "asteroid"


def warmup_counts(policy: str, num_stages: int, num_microbatches: int) -> list[int]:
    """K_p of every stage under a resolved policy (``"asteroid"`` or ``"torch"``)."""
    rule = {"asteroid": asteroid_warmup, "torch": torch_warmup}.get(policy)
    if rule is None:
        raise ConfigError(f"resolve warmup {policy!r} first: asteroid or torch")
    return [rule(num_stages, p, num_microbatches) for p in range(num_stages)]


def stages_share_cores(endpoints: Iterable[str]) -> bool:
    """Whether two of the stages run on one host, judged from their data endpoints
    (``tcp://HOST:PORT``; ``ipc://`` and loopback addresses are this host)."""
    hosts: set[str] = set()
    for endpoint in endpoints:
        parts = urlsplit(endpoint)
        host = "local" if parts.scheme in ("ipc", "inproc") else (parts.hostname or "")
        if host in _LOOPBACK:
            host = "local"
        if host in hosts:
            return True
        hosts.add(host)
    return False
