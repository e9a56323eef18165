"""The synthetic transformer profiles and PipeEdge Table IV's clusters of
``bench/planner.py`` (split out of that script to keep it small; behaviour
unchanged; the script's docstring says where the numbers come from).
"""

from __future__ import annotations

import dataclasses

from zpipe.planner import ClusterDevice, ClusterSpec
from zpipe.planner.cluster import ClusterLink
from zpipe.planner.profile import ModelProfile, synthetic_profile

F32 = 4
GIB = 1 << 30
RCC_S_PER_VIT_LARGE = 2.43 / 10.59  # images/s of one RCC-VE (PipeEdge section V-A)
MINNOW_SPEED = 0.6
UNIT_OVERHEAD_S = 1e-3  # per unit and call: layer norms, residuals, framework


@dataclasses.dataclass(frozen=True)
class Transformer:
    name: str
    hidden: int
    blocks: int
    tokens: int
    heads: int
    input_bytes: int
    embed_params: int
    embed_flops: float
    head_params: int
    head_out: int

    def units(self) -> list[tuple[str, float, int, int, int]]:
        """(name, FLOPs, param bytes, output bytes, activation bytes) per unit."""
        h, t = self.hidden, self.tokens
        act = t * h * F32
        rows = [("embed", self.embed_flops, self.embed_params * F32, act, act + self.input_bytes)]
        for b in range(self.blocks):
            scores = self.heads * t * t * F32
            rows += [
                # LN, QKV, scores, softmax, values: output is the context plus the residual
                (
                    f"b{b}.attn",
                    6.0 * t * h * h + 4.0 * t * t * h,
                    (3 * h * h + 5 * h) * F32,
                    2 * act,
                    3 * act + scores + 2 * act,
                ),
                (f"b{b}.proj", 2.0 * t * h * h, (h * h + h) * F32, act, 3 * act),
                # LN and fc1: four times as wide, plus the residual
                (f"b{b}.fc1", 8.0 * t * h * h, (4 * h * h + 6 * h) * F32, 5 * act, 6 * act),
                (f"b{b}.fc2", 8.0 * t * h * h, (4 * h * h + h) * F32, act, 6 * act),
            ]
        rows.append(
            ("head", 2.0 * h * self.head_out, self.head_params * F32, self.head_out * F32, act)
        )
        return rows

    def total_flops(self) -> float:
        return sum(u[1] for u in self.units())


def _vit(name: str, hidden: int, blocks: int, patch: int) -> Transformer:
    tokens = (224 // patch) ** 2 + 1
    return Transformer(
        name=name,
        hidden=hidden,
        blocks=blocks,
        tokens=tokens,
        heads=16,
        input_bytes=3 * 224 * 224 * F32,
        embed_params=3 * patch * patch * hidden + (tokens + 2) * hidden,
        embed_flops=2.0 * (tokens - 1) * 3 * patch * patch * hidden,
        head_params=2 * hidden + hidden * 1000 + 1000,
        head_out=1000,
    )


VIT_LARGE = _vit("vit-large", 1024, 24, 16)
VIT_HUGE = _vit("vit-huge", 1280, 32, 14)
BERT_LARGE = Transformer(
    name="bert-large",
    hidden=1024,
    blocks=24,
    tokens=512,
    heads=16,
    input_bytes=512 * 8,  # int64 token ids
    embed_params=(30522 + 512 + 2) * 1024 + 2 * 1024,
    embed_flops=10.0 * 512 * 1024,
    head_params=1024 * 1024 + 1024 + 2 * 1024 + 2,
    head_out=2,
)
MODELS = (VIT_LARGE, VIT_HUGE, BERT_LARGE)
FLOPS_PER_S = VIT_LARGE.total_flops() / (1.0 / RCC_S_PER_VIT_LARGE)


def profile_of(model: Transformer, merge: int = 1, fold_ends: bool = False) -> ModelProfile:
    """``model``'s profile; ``merge`` joins that many units of a block, ``fold_ends`` puts the
    embedding into the first unit and the head into the last (exactly 4 * blocks / merge units)."""
    rows = model.units()
    body = rows[1:-1]
    groups: list[list[tuple[str, float, int, int, int]]] = [
        body[k : k + merge] for k in range(0, len(body), merge)
    ]
    if fold_ends:
        groups[0].insert(0, rows[0])
        groups[-1].append(rows[-1])
    else:
        groups = [[rows[0]], *groups, [rows[-1]]]
    names, times, params, outs, mems = [], [], [], [], []
    for g in groups:
        names.append("+".join(u[0] for u in g))
        times.append(sum(u[1] for u in g) / FLOPS_PER_S + UNIT_OVERHEAD_S * len(g))
        params.append(sum(u[2] for u in g))
        outs.append(g[-1][3])
        mems.append(max(u[4] for u in g))
    return synthetic_profile(
        times,
        outs,
        param_bytes=params,
        memory_bytes=mems,
        input_bytes=model.input_bytes,
        names=names,
    )


# (count, name, CPU share or MinnowBoard, memory GiB, Mbit/s) per row of PipeEdge Table IV.
TABLE_IV: dict[int, list[tuple[int, str, float, int, float]]] = {
    1: [(8, "rcc", 1.0, 8, 1000), (8, "minnow", 1.0, 2, 1000)],
    2: [
        (4, "rcc", 1.0, 8, 1000),
        (4, "rcc", 0.75, 4, 1000),
        (4, "rcc", 0.25, 4, 1000),
        (4, "minnow", 1.0, 2, 1000),
    ],
    3: [(8, "rcc", 1.0, 8, 40), (8, "minnow", 1.0, 2, 10)],
    4: [
        (4, "rcc", 1.0, 8, 30),
        (4, "rcc", 1.0, 8, 20),
        (4, "minnow", 1.0, 2, 10),
        (4, "minnow", 1.0, 2, 5),
    ],
    5: [(3, "rcc", 1.0, 8, 50), (8, "rcc", 0.10, 4, 20)],
    6: [
        (5, "minnow", 1.0, 2, 30),
        (2, "rcc", 1.0, 8, 100),
        (3, "rcc", 0.75, 4, 60),
        (4, "rcc", 0.50, 4, 40),
        (3, "rcc", 0.25, 4, 20),
        (2, "rcc", 0.10, 4, 10),
        (2, "minnow", 1.0, 2, 80),
    ],
}

# PipeEdge section V-B: measured throughput (items/s) of PipeEdge and of GPipe/PipeDream
# (their average over 10 orders; the paper reports one number for both).
PAPER: dict[int, dict[str, tuple[float, float]]] = {
    1: {"vit-large": (2.23, 1.99), "vit-huge": (0.88, 0.81), "bert-large": (0.96, 0.89)},
    2: {"vit-large": (1.69, 0.76), "vit-huge": (0.67, 0.31), "bert-large": (0.78, 0.35)},
    3: {"vit-large": (1.37, 1.02), "vit-huge": (0.53, 0.44), "bert-large": (0.58, 0.35)},
    4: {"vit-large": (1.05, 0.55), "vit-huge": (0.51, 0.31), "bert-large": (0.49, 0.29)},
    5: {"vit-large": (0.99, 0.26), "vit-huge": (0.39, 0.10), "bert-large": (0.47, 0.15)},
    6: {"vit-large": (1.33, 0.33), "vit-huge": (0.57, 0.14), "bert-large": (0.59, 0.17)},
}
# Speedups the paper states outright (vs PipeDream's average throughput).
PAPER_STATED: dict[tuple[int, str], float] = {
    (4, "vit-large"): 1.90, (4, "vit-huge"): 1.54,
    (5, "vit-large"): 3.75, (5, "vit-huge"): 3.84, (5, "bert-large"): 3.13,
    (6, "vit-large"): 3.98, (6, "vit-huge"): 4.16, (6, "bert-large"): 3.47,
}  # fmt: skip


def table_iv_cluster(case: int) -> ClusterSpec:
    shaped = case >= 3  # the paper adds 20 ms per link when it shapes bandwidth
    devices = []
    for row, (count, kind, cpu, mem_gib, mbps) in enumerate(TABLE_IV[case]):
        speed = cpu * (MINNOW_SPEED if kind == "minnow" else 1.0)
        for k in range(count):
            devices.append(
                ClusterDevice(
                    name=f"{kind}{row}_{k}",
                    memory_bytes=mem_gib * GIB,
                    speed=speed,
                    bandwidth_mbps=mbps,
                    latency_ms=10.0 if shaped else 0.1,
                )
            )
    return ClusterSpec(tuple(devices), client=ClusterLink(bandwidth_mbps=1000.0, latency_ms=0.0))
