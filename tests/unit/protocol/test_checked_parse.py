"""A body the codec checked is not checked again, and the typed message built without
the frozen dataclass's ``__init__`` is the one it would have built (issue 34)."""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import zpipe
from zpipe._errors import ProtocolError
from zpipe.protocol import REGISTRY, Message, WireMessage, _schema, registry
from zpipe.protocol._schema import STR, wire, wire_message
from zpipe.protocol.data_plane import MESSAGES, Data, MicroBatchError
from zpipe.protocol.registry import Registry
from zpipe.transport import codec

_SAMPLES: dict[type, Any] = {int: 7, float: 1.5, str: "s", bool: True, dict: {"k": 1}, list: [0, 2]}


def _sample_message(cls: type[WireMessage], *, with_optionals: bool) -> Message:
    """A message of ``cls``'s kind with a value of its first wire type in each field
    (optional fields left out unless ``with_optionals``)."""
    body = {}
    for f in cls.wire_fields():
        if f.schema.required or with_optionals:
            first = next(t for t in f.schema.types if t is not type(None))
            body[f.key] = _SAMPLES[first]
    tensors = (torch.arange(4.0),) if cls.CARRIES_TENSORS else ()
    return Message(cls.KIND, body, epoch=3, tensors=tensors)


def _same(fast: WireMessage, slow: WireMessage) -> None:
    assert type(fast) is type(slow)
    assert fast == slow and repr(fast) == repr(slow)
    assert list(vars(fast)) == list(vars(slow))  # the same attributes, in the same order
    for name, value in vars(slow).items():
        assert getattr(fast, name) is value or getattr(fast, name) == value, name


@pytest.mark.parametrize("with_optionals", [False, True])
@pytest.mark.parametrize("cls", list(REGISTRY.classes.values()), ids=lambda c: c.KIND)
def test_every_kind_built_from_a_checked_body_equals_the_one_from_message(
    cls: type[WireMessage], with_optionals: bool
) -> None:
    message = _sample_message(cls, with_optionals=with_optionals)
    _same(cls.from_checked(message), cls.from_message(message))


def test_a_checked_body_builds_the_message_without_calling_its_init(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    message = _sample_message(Data, with_optionals=True)
    slow = Data.from_message(message)

    def refuse(self: object, **_: object) -> None:
        raise AssertionError("the dataclass's __init__ ran")

    monkeypatch.setattr(Data, "__init__", refuse)
    fast = Data.from_checked(message)
    assert fast == slow and fast.tensors == message.tensors
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.mb = 1  # type: ignore[misc]
    monkeypatch.undo()
    assert dataclasses.replace(fast, mb=9) == dataclasses.replace(slow, mb=9) and fast.mb == 7


def test_a_kind_whose_init_does_more_is_built_by_its_init() -> None:
    @wire_message
    class Checked(WireMessage):
        KIND: ClassVar[str] = "checked_post_init"
        name: str = wire(STR)
        calls: ClassVar[list[str]] = []

        def __post_init__(self) -> None:
            type(self).calls.append(self.name)

    built = Checked.from_checked(Message("checked_post_init", {"name": "a"}))
    assert built == Checked(name="a") and Checked.calls == ["a", "a"]


def test_reading_a_checked_message_still_refuses_the_wrong_kind_or_tensors() -> None:
    with pytest.raises(ProtocolError, match="reads 'data' messages"):
        Data.from_checked(Message("error", {}))
    error = _sample_message(MicroBatchError, with_optionals=True)
    with pytest.raises(ProtocolError, match="carries no tensors"):
        MicroBatchError.from_checked(dataclasses.replace(error, tensors=(torch.zeros(1),)))


def test_a_whole_microbatch_is_built_as_the_frozen_dataclass_was() -> None:
    tensors = (torch.ones(2, 3), torch.zeros(1))
    fast = Data.of_microbatch(run=2, mb=5, src="s1", tensors=tensors, epoch=4)
    slow = Data(run=2, mb=5, src="s1", tensors=tensors, epoch=4)
    _same(fast, slow)
    assert fast.tensors is tensors and hash(fast) == hash(slow)
    assert (fast.rows, fast.total, fast.end) == (None, None, None)
    assert fast.to_message().body == slow.to_message().body
    assert dataclasses.replace(fast, mb=6) == dataclasses.replace(slow, mb=6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.src = "other"  # type: ignore[misc]
    # every field of Data is set: a field added to Data must be added there too
    assert set(vars(fast)) == {f.name for f in dataclasses.fields(Data)}


def _counting_registry(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[Registry, list[str]]:
    """A registry of the data-plane kinds whose body checks, and those of the typed
    classes' ``from_message``, are counted (kind by kind) in the list returned."""
    checks: list[str] = []
    flat_body_check, check_body = _schema.flat_body_check, _schema.check_body

    def counting(schema: _schema.Schema) -> Callable[[Any], bool]:
        fits = flat_body_check(schema)

        def count(body: Any) -> bool:
            checks.append("flat")
            return fits(body)

        return count

    def counting_full(kind: str, schema: _schema.Schema, body: Any) -> dict[str, Any]:
        checks.append("full")
        return check_body(kind, schema, body)

    monkeypatch.setattr(registry, "flat_body_check", counting)
    monkeypatch.setattr(registry, "check_body", counting_full)
    monkeypatch.setattr(_schema, "_READERS", {})  # from_message builds its checks anew
    monkeypatch.setattr(_schema, "flat_body_check", counting)
    monkeypatch.setattr(_schema, "check_body", counting_full)
    return Registry(MESSAGES), checks


@pytest.mark.parametrize(
    ("rows", "codec_checks"),
    [(None, ["flat"]), ([0, 2], ["flat", "full"])],  # a list field takes the full check
)
def test_a_decoded_body_is_checked_once(
    monkeypatch: pytest.MonkeyPatch, rows: list[int] | None, codec_checks: list[str]
) -> None:
    checked_registry, checks = _counting_registry(monkeypatch)
    sent = Data(run=1, mb=2, src="up", rows=rows, total=2, tensors=(torch.ones(2),), epoch=1)
    frames = codec.encode(sent.to_message(), registry=checked_registry)
    checks.clear()
    # the old path (what the data port did): the codec's check, then from_message's
    twice = checked_registry.parse(codec.decode(frames, registry=checked_registry))
    assert checks == codec_checks * 2
    checks.clear()
    once = codec.decode_typed(frames, registry=checked_registry)
    assert checks == codec_checks and once == twice == sent


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"run": 1, "mb": -1, "src": "up"}, "'mb' must be >= 0"),
        ({"run": "1", "mb": 0, "src": "up"}, "'run' must be int"),
        ({"run": 1, "mb": 0}, "missing field 'src'"),
        ({"run": 1, "mb": 0, "src": "up", "extra": 1}, "unexpected field"),
        ({"run": 1, "mb": 0, "src": "up", "rows": [[[]]]}, None),  # nested: the full check
    ],
)
def test_a_typed_decode_refuses_what_the_codec_refuses(
    body: dict[str, Any], error: str | None
) -> None:
    header = codec._packer().pack({"v": 1, "k": "data", "e": 0, "b": body, "t": []})
    if error is None:
        assert codec.decode_typed([header]) == Data(run=1, mb=0, src="up", rows=[[[]]])
        return
    with pytest.raises(ProtocolError, match=error):
        codec.decode_typed([header])


def test_a_typed_decode_refuses_a_kind_without_a_typed_class() -> None:
    plain = Registry()
    plain.add_schema("untyped", {"n": ((int,), True)}, carries_tensors=False)
    header = codec._packer().pack({"v": 1, "k": "untyped", "e": 0, "b": {"n": 1}, "t": []})
    assert codec.decode([header], registry=plain).body == {"n": 1}
    with pytest.raises(ProtocolError, match="has no typed class"):
        codec.decode_typed([header], registry=plain)


# what decodes frames into an untyped Message (its body checked), and what parses one
_DECODES = {"decode", "decode_frames", "decode_sink_message"}


def _calls(function: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            target = node.func
            if isinstance(target, ast.Name):
                names.add(target.id)
            elif isinstance(target, ast.Attribute):
                owner = target.value
                prefix = f"{owner.id}." if isinstance(owner, ast.Name) else ""
                names.add(prefix + target.attr)
    return names


def test_no_receive_path_decodes_then_parses_a_message() -> None:
    """Every receive path goes from frames to its protocol class through
    ``decode_typed`` (the body checked once): a function of zpipe that decodes to an
    untyped message and parses it with the registry checks the body twice."""
    package = Path(zpipe.__file__).parent
    twice = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                calls = _calls(node)
                if calls & _DECODES and "REGISTRY.parse" in calls:
                    twice.append(f"{path.relative_to(package)}:{node.lineno} {node.name}")
    assert twice == []
