"""Eco-FL's adaptive client grouping (section 5.2, eq. 4, Algorithm 1), pure.

Three phases, all driven by what the server knows of each client: its
response latency L_n and its label counts (never its samples).

- Initial grouping: K-means on latency gives |G| centres L^g (scikit-learn,
  seeded); each group gets a latency threshold RT^g (``rt_factor`` times its
  K-means radius, at least ``rt_floor_fraction`` of its centre). Then the
  groups take turns picking, from the pool, the client of smallest

      COST_n^g = |L^g - L_n| + lambda * JS(pi_n^g, pi_iid)          (eq. 4)

  where pi_n^g is the label distribution of the group together with client
  n and pi_iid that of all clients, never a client outside RT^g. Clients no
  group may take are dropped out for now.
- Dynamic regrouping (Algorithm 1): a latency observation that puts a member
  outside its group's range moves it to the eligible group of smallest cost,
  or drops it out.
- Re-admission: a dropped client whose latency comes back inside some
  group's range joins the eligible group of smallest cost.
- Late joins: a client that registers after the run started is associated
  like a re-admitted one (the eligible group of smallest eq. 4 cost, FedAT's
  nearest tier in ``latency`` mode), or dropped out until its latency fits.

Modes give the baselines the same interface: ``latency`` keeps the K-means
clusters as they are (FedAT's tiers, lambda = 0, never regrouped), ``data``
associates by JS divergence alone with no thresholds (Astraea's grouping,
lambda = +inf). ``eco`` with ``dynamic=False`` is "Eco-FL w/o DG".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError
from zpipe.federated.divergence import js_divergence, js_divergence_rows, label_distribution

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

GROUPING_MODES = ("eco", "latency", "data")


@dataclass(frozen=True)
class ClientProfile:
    """What a client tells the server: its response latency and its label counts."""

    client_id: int
    latency_s: float
    label_counts: tuple[int, ...]

    @property
    def n_samples(self) -> int:
        return int(sum(self.label_counts))


@dataclass(frozen=True)
class GroupingPolicy:
    mode: str = "eco"
    n_groups: int = 5
    lam: float = 10.0  # seconds of latency distance one unit of JS divergence is worth
    rt_factor: float = 1.0
    rt_floor_fraction: float = 0.1
    dynamic: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in GROUPING_MODES:
            raise ConfigError(f"grouping mode {self.mode!r} is not one of {GROUPING_MODES}")
        if self.n_groups < 1:
            raise ConfigError("the number of groups must be at least 1")
        if not self.lam >= 0:
            raise ConfigError("lambda must be >= 0 (math.inf for data-only grouping)")
        if not (self.rt_factor > 0 and self.rt_floor_fraction >= 0):
            raise ConfigError("rt_factor must be > 0 and rt_floor_fraction >= 0")


@dataclass
class Group:
    group_id: int
    center_s: float  # L^g
    threshold_s: float  # RT^g
    members: set[int] = field(default_factory=set)
    label_counts: FloatArray = field(default_factory=lambda: np.zeros(0))

    def admits(self, latency_s: float) -> bool:
        return abs(self.center_s - latency_s) <= self.threshold_s


@dataclass(frozen=True)
class GroupChange:
    """One membership change: ``moved`` (Algorithm 1), ``dropped`` or ``readmitted``."""

    client_id: int
    kind: str
    from_group: int | None
    to_group: int | None


def kmeans_latency_clusters(
    latencies: Sequence[float], n_groups: int, *, seed: int
) -> tuple[list[float], IntArray]:
    """1-D K-means on latency: centres in ascending order and each client's cluster index."""
    values = np.asarray(latencies, dtype=np.float64).reshape(-1, 1)
    if len(values) == 0:
        raise ConfigError("grouping needs at least one client")
    try:
        from sklearn.cluster import KMeans
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("grouping needs scikit-learn: pip install 'zpipe[lossy]'") from exc
    k = min(n_groups, len(np.unique(values)))
    model = KMeans(n_clusters=k, n_init=10, random_state=seed).fit(values)
    order = np.argsort(model.cluster_centers_.ravel())
    rank = np.empty_like(order)
    rank[order] = np.arange(k)
    centers = [float(c) for c in model.cluster_centers_.ravel()[order]]
    return centers, np.asarray(rank[model.labels_], dtype=np.int64)


class Grouping:
    """Group membership of one federated run, changed only by latency observations."""

    def __init__(self, profiles: Iterable[ClientProfile], policy: GroupingPolicy) -> None:
        self.policy = policy
        ordered = sorted(profiles, key=lambda p: p.client_id)
        if not ordered:
            raise ConfigError("grouping needs at least one client")
        widths = {len(p.label_counts) for p in ordered}
        if len(widths) != 1:
            raise ConfigError("every client must report label counts over the same classes")
        self.client_ids = [p.client_id for p in ordered]
        if len(set(self.client_ids)) != len(self.client_ids):
            raise ConfigError("client ids must be unique")
        self.latency: dict[int, float] = {p.client_id: float(p.latency_s) for p in ordered}
        self.counts: dict[int, FloatArray] = {
            p.client_id: np.asarray(p.label_counts, dtype=np.float64) for p in ordered
        }
        self.pi_iid = label_distribution(sum(self.counts.values()))
        self.groups: list[Group] = []
        self.group_of: dict[int, int] = {}
        self.dropped: set[int] = set()
        self.association_order: list[tuple[int, int]] = []  # (client, group) as picked
        self._initial_grouping()

    # -- eq. 4 ------------------------------------------------------------------------

    def _latency_weight_and_lambda(self) -> tuple[float, float]:
        if self.policy.mode == "data" or math.isinf(self.policy.lam):
            return 0.0, 1.0  # lambda = +inf: only the JS term orders the candidates
        if self.policy.mode == "latency":
            return 1.0, 0.0
        return 1.0, self.policy.lam

    def cost(self, client_id: int, group: Group) -> float:
        """COST_n^g of eq. 4 (the group's counts without ``client_id``, then with it)."""
        counts = group.label_counts.copy()
        if client_id in group.members:
            counts -= self.counts[client_id]
        union = counts + self.counts[client_id]
        w_latency, lam = self._latency_weight_and_lambda()
        distance = abs(group.center_s - self.latency[client_id])
        return w_latency * distance + lam * js_divergence(union, self.pi_iid)

    # -- initial grouping -------------------------------------------------------------

    def _initial_grouping(self) -> None:
        ids = self.client_ids
        latencies = np.array([self.latency[c] for c in ids])
        centers, labels = kmeans_latency_clusters(
            latencies.tolist(), self.policy.n_groups, seed=self.policy.seed
        )
        n_classes = len(self.pi_iid)
        for g, center in enumerate(centers):
            radius = float(np.max(np.abs(latencies[labels == g] - center)))
            threshold = self.policy.rt_factor * max(
                radius, self.policy.rt_floor_fraction * abs(center)
            )
            if self.policy.mode == "data":
                threshold = math.inf  # Astraea ignores latency
            self.groups.append(Group(g, center, threshold, set(), np.zeros(n_classes)))
        if self.policy.mode == "latency":
            for client_id, label in zip(ids, labels, strict=True):
                self._join(client_id, int(label))
            return
        self._associate(list(ids))

    def _associate(self, pool_ids: list[int]) -> None:
        """Groups take turns taking the pool client of smallest eq. 4 cost in their range."""
        pool = np.asarray(sorted(pool_ids), dtype=np.int64)
        latency = np.array([self.latency[int(c)] for c in pool])
        counts = np.array([self.counts[int(c)] for c in pool]).reshape(len(pool), -1)
        in_pool = np.ones(len(pool), dtype=bool)
        w_latency, lam = self._latency_weight_and_lambda()
        progressed = True
        while progressed and in_pool.any():
            progressed = False
            for group in self.groups:
                candidates = np.flatnonzero(
                    in_pool & (np.abs(latency - group.center_s) <= group.threshold_s)
                )
                if len(candidates) == 0:
                    continue
                distance = np.abs(latency[candidates] - group.center_s)
                js = js_divergence_rows(group.label_counts + counts[candidates], self.pi_iid)
                costs = w_latency * distance + lam * js
                # argmin takes the first of equal costs: the smallest client id
                chosen = int(candidates[int(np.argmin(costs))])
                self._join(int(pool[chosen]), group.group_id)
                self.association_order.append((int(pool[chosen]), group.group_id))
                in_pool[chosen] = False
                progressed = True
                if not in_pool.any():
                    break
        self.dropped.update(int(c) for c in pool[in_pool])

    def _join(self, client_id: int, group_id: int) -> None:
        group = self.groups[group_id]
        group.members.add(client_id)
        group.label_counts = group.label_counts + self.counts[client_id]
        self.group_of[client_id] = group_id
        self.dropped.discard(client_id)

    def _leave(self, client_id: int) -> int:
        group_id = self.group_of.pop(client_id)
        group = self.groups[group_id]
        group.members.discard(client_id)
        group.label_counts = group.label_counts - self.counts[client_id]
        return group_id

    # -- late joins -------------------------------------------------------------------

    def add_client(self, profile: ClientProfile) -> GroupChange:
        """Associate a client that joined a started run (eq. 4 against the current groups).

        pi_iid becomes the label distribution of every client, the new one included."""
        client_id = profile.client_id
        if client_id in self.latency:
            raise ConfigError(f"client {client_id} is already in the run")
        if len(profile.label_counts) != len(self.pi_iid):
            raise ConfigError("every client must report label counts over the same classes")
        if not (profile.latency_s >= 0 and math.isfinite(profile.latency_s)):
            raise ConfigError(f"client {client_id} reported a latency of {profile.latency_s!r}")
        self.client_ids = sorted([*self.client_ids, client_id])
        self.latency[client_id] = float(profile.latency_s)
        self.counts[client_id] = np.asarray(profile.label_counts, dtype=np.float64)
        self.pi_iid = label_distribution(sum(self.counts.values()))
        if self.policy.mode == "latency":
            target: int | None = min(
                self.groups, key=lambda g: (abs(g.center_s - profile.latency_s), g.group_id)
            ).group_id
        else:
            target = self._best_eligible_group(client_id)
        if target is None:
            self.dropped.add(client_id)
            return GroupChange(client_id, "dropped", None, None)
        self._join(client_id, target)
        return GroupChange(client_id, "joined", None, target)

    # -- Algorithm 1 and re-admission -------------------------------------------------

    def _best_eligible_group(self, client_id: int) -> int | None:
        latency = self.latency[client_id]
        best: tuple[float, int] | None = None
        for group in self.groups:
            if not group.admits(latency):
                continue
            cost = self.cost(client_id, group)
            if best is None or cost < best[0]:
                best = (cost, group.group_id)
        return None if best is None else best[1]

    def observe_latency(self, client_id: int, latency_s: float) -> GroupChange | None:
        """Record a newly measured L_n; regroup, drop or re-admit the client if needed."""
        if client_id not in self.latency:
            raise ConfigError(f"latency reported for unknown client {client_id}")
        if not (latency_s >= 0 and math.isfinite(latency_s)):
            raise ConfigError(f"client {client_id} reported a latency of {latency_s!r}")
        self.latency[client_id] = float(latency_s)
        if not self.policy.dynamic or self.policy.mode != "eco":
            return None
        if client_id in self.dropped:
            target = self._best_eligible_group(client_id)
            if target is None:
                return None
            self._join(client_id, target)
            return GroupChange(client_id, "readmitted", None, target)
        current = self.groups[self.group_of[client_id]]
        if current.admits(latency_s):
            return None
        self._leave(client_id)
        target = self._best_eligible_group(client_id)
        if target is None:
            self.dropped.add(client_id)
            return GroupChange(client_id, "dropped", current.group_id, None)
        self._join(client_id, target)
        return GroupChange(client_id, "moved", current.group_id, target)

    def drop_silent(self, client_id: int, waited_s: float) -> GroupChange | None:
        """A client that did not answer a task within ``waited_s``: out of its group.

        A timeout is only a lower bound of the client's latency, so it cannot place the
        client in a range (a loaded run's wide range could admit the bound and keep a
        dead client in its group); a silent client is dropped, and its next measured
        latency (a probe's round trip) re-admits it as Algorithm 1 does."""
        if client_id not in self.latency:
            raise ConfigError(f"latency reported for unknown client {client_id}")
        if not (waited_s >= 0 and math.isfinite(waited_s)):
            raise ConfigError(f"client {client_id} waited for {waited_s!r}")
        self.latency[client_id] = max(self.latency[client_id], float(waited_s))
        if not self.policy.dynamic or self.policy.mode != "eco" or client_id in self.dropped:
            return None
        group_id = self._leave(client_id)
        self.dropped.add(client_id)
        return GroupChange(client_id, "dropped", group_id, None)

    # -- what Figs. 8 and 9 report -----------------------------------------------------

    def group_js(self, group: Group) -> float:
        return js_divergence(group.label_counts, self.pi_iid)

    def mean_js(self) -> float:
        """Mean JS divergence of the non-empty groups' label distributions from pi_iid."""
        values = [self.group_js(g) for g in self.groups if g.members]
        return float(np.mean(values)) if values else math.nan

    def mean_group_latency(self) -> float:
        """Mean over non-empty groups of their members' mean latency (Fig. 9, middle)."""
        values = [np.mean([self.latency[c] for c in g.members]) for g in self.groups if g.members]
        return float(np.mean(values)) if values else math.nan

    def members_of(self, group_id: int) -> list[int]:
        return sorted(self.groups[group_id].members)
