"""A small CNN: conv + BatchNorm + ReLU (+ max-pool) units, then a flatten + linear head.

The first unit does not pool, so early units emit the largest activations and
later ones ever smaller: the shape of the trade-off that activation-aware
partitioning planners care about.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zpipe.models._config import ConfigReader
from zpipe.models.base import UnitwiseSequence, check_batch_size
from zpipe.models.spec import ModelSpec


class ConvUnit(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, *, pool: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(out_channels)
        self.pool = pool
        # Non-trivial running statistics, so eval-mode BatchNorm is not an identity and
        # tests notice when a unit's buffers are lost or mixed up.
        channels = (out_channels,)
        self.norm.running_mean = torch.randn(channels) * 0.1
        self.norm.running_var = torch.rand(channels) + 0.5
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.normal_(0.0, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm(self.conv(x)))
        return F.max_pool2d(out, 2) if self.pool else out

    def extra_repr(self) -> str:
        return f"pool={self.pool}"


class ClassifierHead(nn.Module):
    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


class CnnSequence(UnitwiseSequence):
    """config: channels (list), num_classes, image_size, in_channels, pool (list of bools)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        reader = ConfigReader(spec.config, family="cnn")
        self.channels = reader.get_int_list("channels", min_len=1, minimum=1)
        self.num_classes = reader.get_int("num_classes", default=10, minimum=1)
        self.image_size = reader.get_int("image_size", default=32, minimum=1)
        self.in_channels = reader.get_int("in_channels", default=3, minimum=1)
        default_pool = [index > 0 for index in range(len(self.channels))]
        self.pool = reader.get_bool_list("pool", default=default_pool)
        reader.finish()
        if len(self.pool) != len(self.channels):
            raise reader.error(
                "pool", f"needs one entry per conv layer ({len(self.channels)}), got {self.pool}"
            )
        size = self.image_size
        for pool in self.pool:
            if pool:
                if size < 2:
                    raise reader.error("pool", f"too many pools for image_size={self.image_size}")
                size //= 2
        self.final_size = size

    @property
    def num_units(self) -> int:
        return len(self.channels) + 1

    def unit_names(self) -> list[str]:
        return [*(f"conv{i}" for i in range(len(self.channels))), "head"]

    def parameter_elements(self, start: int, end: int) -> int:
        """Parameters and buffers of units ``[start, end)``, from the config alone."""
        total = 0
        for index in range(start, end):
            if index == len(self.channels):
                features = self.channels[-1] * self.final_size**2
                total += features * self.num_classes + self.num_classes
                continue
            previous = self.in_channels if index == 0 else self.channels[index - 1]
            out = self.channels[index]
            # 3x3 conv without bias; BatchNorm: weight, bias, mean, var, step count
            total += 9 * previous * out + 4 * out + 1
        return total

    def largest_boundary_bytes(self) -> int:
        """The largest float32 feature map (the image, each conv's output), per sample."""
        size, most = self.image_size, self.in_channels * self.image_size**2
        for channels, pool in zip(self.channels, self.pool, strict=True):
            size = size // 2 if pool else size
            most = max(most, channels * size**2)
        return 4 * max(most, self.num_classes)

    def make_unit(self, index: int) -> nn.Module:
        if index == len(self.channels):
            features = self.channels[-1] * self.final_size**2
            return ClassifierHead(features, self.num_classes)
        previous = self.in_channels if index == 0 else self.channels[index - 1]
        return ConvUnit(previous, self.channels[index], pool=self.pool[index])

    def example_input(self, batch_size: int, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
        check_batch_size(batch_size)
        generator = torch.Generator().manual_seed(seed)
        shape = (batch_size, self.in_channels, self.image_size, self.image_size)
        return (torch.randn(shape, generator=generator),)
