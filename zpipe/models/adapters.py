"""Adapters for user models built by a factory named in the spec ("module:callable").

`sequential`: the factory returns an nn.Sequential; its children are the units.
`traced`: the factory returns any module torch.export can trace; it is cut
automatically with torch.distributed.pipelining (see _tracing.py).

The factory is imported by module path (never unpickled), so it must be
importable on every machine. Both adapters build the user's module *whole*,
once per build_units() call, under torch.manual_seed(spec.seed), and keep only
the requested units: a factory module's weights cannot be built piecewise.

Trust: importing and calling a factory runs code named by the spec, so the
factory path is checked against the process's policy (zpipe.models.trust)
before anything is imported: a peer's spec may name only what this process's
operator allowed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zpipe._errors import ConfigError, ModelSpecError
from zpipe.models._config import ConfigReader
from zpipe.models._seeding import seeded
from zpipe.models._tracing import TRACED_BODY, trace_and_split
from zpipe.models.base import check_batch_size, finish_units
from zpipe.models.sequence import check_unit_range
from zpipe.models.size import check_peer_module
from zpipe.models.spec import ModelSpec
from zpipe.models.trust import FactoryPolicy, factory_policy, split_factory_path
from zpipe.models.weights import unit_key

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}


def resolve_factory(path: str, *, policy: FactoryPolicy, family: str) -> Callable[..., Any]:
    """The callable named by "package.module:attribute[.attribute...]", if `policy` allows
    it: the check reads the string only, so a refused factory's module is never imported."""
    try:
        module_name, attributes = split_factory_path(path)
    except ConfigError as exc:
        raise ModelSpecError(str(exc)) from None
    policy.check(path, family=family)
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # an import can fail with anything its module raises
        raise ModelSpecError(
            f"cannot import module {module_name!r} of factory {path!r} "
            f"({type(exc).__name__}: {exc}); is it installed on this machine?"
        ) from exc
    for attribute in attributes.split("."):
        if not hasattr(target, attribute):
            raise ModelSpecError(f"factory {path!r}: {module_name} has no {attributes!r}")
        target = getattr(target, attribute)
    policy.check_defined_in_module(path, target)
    if not callable(target):
        raise ModelSpecError(f"factory {path!r} is not callable")
    return target


@dataclass(frozen=True)
class FactoryConfig:
    path: str
    factory: Callable[..., Any]
    kwargs: dict[str, Any]
    input_shape: tuple[int, ...]
    input_dtype: torch.dtype
    input_range: tuple[int, int]

    @classmethod
    def parse(cls, reader: ConfigReader, *, policy: FactoryPolicy, family: str) -> FactoryConfig:
        path = reader.get_str("factory")
        bounds = reader.get_int_list("input_range", default=[0, 10])
        if len(bounds) != 2 or bounds[0] >= bounds[1]:
            raise reader.error("input_range", f"must be [low, high) with low < high, got {bounds}")
        return cls(
            path=path,
            factory=resolve_factory(path, policy=policy, family=family),
            kwargs=reader.get_mapping("kwargs", default={}),
            input_shape=tuple(reader.get_int_list("input_shape", minimum=1)),
            input_dtype=DTYPES[reader.get_str("input_dtype", default="float32", choices=DTYPES)],
            input_range=(bounds[0], bounds[1]),
        )

    def build(self, seed: int, *, meta: bool = False) -> nn.Module:
        """The user's whole module, initialised under torch.manual_seed(seed)."""
        with seeded(seed), torch.device("meta") if meta else nullcontext():
            try:
                module = self.factory(**self.kwargs)
            except Exception as exc:
                raise ModelSpecError(
                    f"factory {self.path!r} raised {type(exc).__name__}: {exc}"
                ) from exc
        if not isinstance(module, nn.Module):
            raise ModelSpecError(
                f"factory {self.path!r} returned {type(module).__name__}, not an nn.Module"
            )
        return module

    def build_checked(self, seed: int, *, from_peer: bool) -> nn.Module:
        """The real module; for a peer's spec, only after its meta twin was counted
        against this device's limit (the kwargs are the peer's choice)."""
        if not from_peer:
            return self.build(seed)
        try:
            structure = self.build(seed, meta=True)
        except ModelSpecError:
            module = self.build(seed)  # cannot run on meta: count what was built
            check_peer_module(module, factory=self.path)
            return module
        check_peer_module(structure, factory=self.path)
        return self.build(seed)

    def build_for_structure(self, seed: int) -> nn.Module:
        """The module for looking at its structure: on the meta device when the factory allows."""
        try:
            return self.build(seed, meta=True)
        except ModelSpecError:
            # Some factories cannot run on the meta device (e.g. they compute with
            # their weights); building for real is slower but always works.
            return self.build(seed)

    def example_input(self, batch_size: int, *, seed: int) -> tuple[torch.Tensor, ...]:
        check_batch_size(batch_size)
        generator = torch.Generator().manual_seed(seed)
        shape = (batch_size, *self.input_shape)
        if self.input_dtype.is_floating_point:
            return (torch.randn(shape, generator=generator).to(self.input_dtype),)
        low, high = self.input_range
        return (torch.randint(low, high, shape, generator=generator, dtype=self.input_dtype),)


def traced_plain_key(index: int, name: str) -> str:
    """A traced unit keeps the traced module's parameter names under "body." (see
    _tracing.py): the module's own state dict names them without it."""
    del index  # the names are unique across the whole traced module
    return name.removeprefix(f"{TRACED_BODY}.")


def _child_label(name: str, child: nn.Module) -> str:
    return f"{type(child).__name__.lower()}{name}" if name.isdigit() else name


class SequentialSequence:
    """config: factory, kwargs, input_shape, input_dtype (, input_range for integer inputs).

    `factories`: which factories may load (default: zpipe.models.trust.factory_policy).
    """

    def __init__(self, spec: ModelSpec, *, factories: FactoryPolicy | None = None) -> None:
        self.spec = spec
        reader = ConfigReader(spec.config, family="sequential")
        policy = factory_policy(from_peer=spec.from_peer, factories=factories)
        self.factory = FactoryConfig.parse(reader, policy=policy, family="sequential")
        reader.finish()
        self._names: list[str] | None = None

    def _build(self, *, meta: bool) -> nn.Sequential:
        module = (
            self.factory.build_for_structure(self.spec.seed)
            if meta
            else self.factory.build_checked(self.spec.seed, from_peer=self.spec.from_peer)
        )
        if not isinstance(module, nn.Sequential):
            raise ModelSpecError(
                f"factory {self.factory.path!r} returned {type(module).__name__}; the "
                "'sequential' family needs an nn.Sequential (use family 'traced' otherwise)"
            )
        return module

    def unit_names(self) -> list[str]:
        if self._names is None:
            module = self._build(meta=True)
            self._names = [_child_label(name, child) for name, child in module.named_children()]
        return list(self._names)

    @property
    def num_units(self) -> int:
        return len(self.unit_names())

    def build_units(self, start: int, end: int) -> list[nn.Module]:
        named = list(self._build(meta=False).named_children())
        check_unit_range(start, end, len(named))
        children = [child for _, child in named]

        def plain_key(index: int, name: str) -> str:
            # the user's own nn.Sequential state dict: "<child name>.<name>"
            return f"{named[index][0]}.{name}"

        return finish_units(children[start:end], start=start, spec=self.spec, plain_key=plain_key)

    def example_input(self, batch_size: int, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
        return self.factory.example_input(batch_size, seed=seed)

    def unit_param_keys(self, index: int) -> list[str]:
        children = list(self._build(meta=True).children())
        check_unit_range(index, index + 1, len(children))
        return [unit_key(index, name) for name in children[index].state_dict()]


class TracedSequence:
    """config: as 'sequential' plus microbatch_size and optional split_points (module FQNs).

    Default split points: every top-level child except the first. The units are
    only valid at `microbatch_size`: the trace fixes every shape.
    """

    def __init__(self, spec: ModelSpec, *, factories: FactoryPolicy | None = None) -> None:
        self.spec = spec
        reader = ConfigReader(spec.config, family="traced")
        policy = factory_policy(from_peer=spec.from_peer, factories=factories)
        self.factory = FactoryConfig.parse(reader, policy=policy, family="traced")
        self.microbatch_size = reader.get_int("microbatch_size", minimum=1)
        self.split_points: list[str] | None = (
            reader.get_str_list("split_points") if reader.has("split_points") else None
        )
        reader.finish()
        self._names: list[str] | None = None

    def _split_points(self, module: nn.Module) -> list[str]:
        if self.split_points is None:
            return [name for name, _ in module.named_children()][1:]
        for fqn in self.split_points:
            try:
                module.get_submodule(fqn)
            except AttributeError as exc:
                raise ModelSpecError(
                    f"split point {fqn!r} is not a submodule of {type(module).__name__}; "
                    "use dotted names from module.named_modules()"
                ) from exc
        return list(self.split_points)

    def unit_names(self) -> list[str]:
        if self._names is None:
            module = self.factory.build_for_structure(self.spec.seed)
            points = self._split_points(module)
            children = [name for name, _ in module.named_children()]
            first = children[0] if children and self.split_points is None else "start"
            self._names = [first, *points]
        return list(self._names)

    @property
    def num_units(self) -> int:
        return len(self.unit_names())

    def _build_all(self) -> list[nn.Module]:
        module = self.factory.build_checked(self.spec.seed, from_peer=self.spec.from_peer)
        # eval() before tracing: the trace bakes in train/eval behaviour (BatchNorm, dropout).
        module.eval()
        points = self._split_points(module)
        example = self.example_input(self.microbatch_size)
        units = trace_and_split(module, example, points)
        if len(units) != len(points) + 1:
            raise ModelSpecError(
                f"splitting at {points} gave {len(units)} stages, expected {len(points) + 1}; "
                "each split point must run exactly once, in order: set split_points explicitly"
            )
        return units

    def build_units(self, start: int, end: int) -> list[nn.Module]:
        units = self._build_all()
        check_unit_range(start, end, len(units))
        return finish_units(
            units[start:end], start=start, spec=self.spec, plain_key=traced_plain_key
        )

    def example_input(self, batch_size: int, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
        return self.factory.example_input(batch_size, seed=seed)

    def unit_param_keys(self, index: int) -> list[str]:
        units = self._build_all()
        check_unit_range(index, index + 1, len(units))
        return [unit_key(index, name) for name in units[index].state_dict()]
