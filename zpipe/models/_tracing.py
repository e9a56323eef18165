"""Split a traceable nn.Module into units that chain like a plain sequence.

`torch.distributed.pipelining.pipeline()` cuts the traced graph at the split
points into submodules `split_gm.submod_pp_<i>` (torch 2.13 naming). Those do
NOT chain on their own: a submodule returns a bare Tensor for one output and a
tuple for several, and a value that skips over stages (a residual) goes
straight from its producer to its consumer, past the stages in between.

zpipe's stages form a chain, so each unit here wraps one submodule in a small
FX graph that takes *every value still needed* (inputs, plus values passing
through) and returns, always as a tuple, every value still needed afterwards;
the last unit returns the model's outputs. Values keep the order in which the
traced graph defines them.

The trace specialises shapes to the example, so units only accept inputs of
the traced micro-batch size; a forward pre-hook says so clearly instead of
letting a reshape deep inside fail.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import fx, nn

from zpipe._errors import ModelSpecError

TRACED_BODY = "body"


class _ShapeGuard:
    """Forward pre-hook: inputs must have the shapes seen when the model was traced."""

    def __init__(self, index: int, shapes: list[tuple[int, ...] | None]) -> None:
        self.index = index
        self.shapes = shapes

    def __call__(self, module: nn.Module, args: tuple[object, ...]) -> None:
        if len(args) != len(self.shapes):
            raise ModelSpecError(
                f"traced unit {self.index} takes {len(self.shapes)} inputs "
                f"(the previous unit's outputs), got {len(args)}"
            )
        for position, (arg, shape) in enumerate(zip(args, self.shapes, strict=True)):
            if shape is not None and isinstance(arg, torch.Tensor) and tuple(arg.shape) != shape:
                raise ModelSpecError(
                    f"traced unit {self.index} input {position} has shape {tuple(arg.shape)}, "
                    f"but the model was traced with {shape}; a traced model's units only run "
                    "at the micro-batch size (and input shape) of the trace: set the spec's "
                    "microbatch_size to the micro-batch size you run"
                )


def trace_and_split(
    module: nn.Module, example: tuple[torch.Tensor, ...], split_points: Sequence[str]
) -> list[nn.Module]:
    """Trace `module` on `example` and cut it before each of `split_points`."""
    # Imported lazily: pulling in torch.distributed costs time that other families need not pay.
    from torch.distributed.pipelining import SplitPoint, pipeline

    split_spec = {fqn: SplitPoint.BEGINNING for fqn in split_points}
    with warnings.catch_warnings():
        # torch's own deprecation noise from inside the tracer, not actionable here.
        warnings.simplefilter("ignore", FutureWarning)
        try:
            pipe = pipeline(module, mb_args=example, split_spec=split_spec)
        except Exception as exc:
            raise ModelSpecError(
                f"cannot trace {type(module).__name__} for splitting at {list(split_points)}: "
                f"{type(exc).__name__}: {exc}. The model must be traceable by torch.export "
                "(no data-dependent control flow)"
            ) from exc
    return chain_submodules(pipe.split_gm)


def _placeholder_shapes(submodule: nn.Module) -> list[tuple[int, ...] | None]:
    """Traced input shapes of a submodule, from its placeholders' fake-tensor metadata."""
    if not isinstance(submodule, fx.GraphModule):
        return []
    shapes: list[tuple[int, ...] | None] = []
    for node in submodule.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("val")
        try:
            shapes.append(tuple(int(d) for d in value.shape) if value is not None else None)
        except (AttributeError, TypeError):  # symbolic or missing: do not guard it
            shapes.append(None)
    return shapes


def chain_submodules(split_gm: fx.GraphModule) -> list[nn.Module]:
    """One chainable unit per `submod_pp_<i>` of a pipeline() split graph."""
    graph = split_gm.graph
    inputs: list[fx.Node] = []
    groups: list[list[fx.Node]] = []
    outputs: list[fx.Node] = []
    for node in graph.nodes:
        if node.op == "placeholder":
            inputs.append(node)
        elif node.op == "call_module":
            groups.append([node])
        elif node.op == "call_function" and groups:
            groups[-1].append(node)  # e.g. getitem on the submodule just called
        elif node.op == "output":
            fx.node.map_arg(node.args[0], outputs.append)
        else:
            raise ModelSpecError(
                f"unexpected {node.op} node {node.name!r} between pipeline stages; "
                "choose other split_points"
            )

    owner: dict[fx.Node, int] = {node: -1 for node in inputs}
    for index, group in enumerate(groups):
        for node in group:
            owner[node] = index
    last = len(groups)  # "used by the model's output"
    last_use = {
        node: max((owner.get(user, last) for user in node.users), default=-1) for node in owner
    }

    # Shapes at trace time, from the placeholders of the submodules that consume each value.
    shape_of: dict[fx.Node, tuple[int, ...] | None] = {}
    for node in inputs:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            shape_of[node] = tuple(int(d) for d in value.shape)
    for group in groups:
        submodule = split_gm.get_submodule(str(group[0].target))
        for arg, shape in zip(group[0].args, _placeholder_shapes(submodule), strict=False):
            if isinstance(arg, fx.Node) and shape is not None:
                shape_of[arg] = shape

    defined = list(owner)  # graph order
    units: list[nn.Module] = []
    live_in = inputs
    for index, group in enumerate(groups):
        if index == last - 1:
            live_out = outputs
        else:
            live_out = [v for v in defined if owner[v] <= index and last_use[v] > index]
        units.append(_make_unit(split_gm, index, group, live_in, live_out))
        units[-1].register_forward_pre_hook(
            _ShapeGuard(index, [shape_of.get(node) for node in live_in])
        )
        live_in = live_out
    return units


def _make_unit(
    split_gm: fx.GraphModule,
    index: int,
    group: list[fx.Node],
    live_in: list[fx.Node],
    live_out: list[fx.Node],
) -> fx.GraphModule:
    body = split_gm.get_submodule(str(group[0].target))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {node: graph.placeholder(node.name) for node in live_in}
    for node in group:
        copy = graph.node_copy(node, lambda n: env[n])
        if node.op == "call_module":
            # One submodule per unit, always called "body": state-dict keys "body.<fqn>".
            copy.target = TRACED_BODY
        env[node] = copy
    graph.output(tuple(env[node] for node in live_out))
    # The unit holds only its own submodule, never the whole split graph (memory).
    return fx.GraphModule({TRACED_BODY: body}, graph, class_name=f"TracedUnit{index}")
