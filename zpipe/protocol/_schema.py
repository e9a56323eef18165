"""How a typed message declares its body, and the one validator of bodies.

Every message kind is a frozen dataclass whose body fields are declared with
:func:`wire`: the wire key, the accepted msgpack types and whether the field
is required. That declaration is the only schema of the kind: the codec
validates bodies against the schema derived from it (:meth:`WireMessage.schema`).

Unknown fields are refused, so a typo in a sender shows up as an error instead
of a silently ignored setting. Nested maps (plans, model specs) are validated
by the code that consumes them.

Absent and null: an optional field is ``None`` in the dataclass when it is
absent on the wire. Where the wire type admits null, ``None`` is sent as an
explicit null (what today's senders do) unless the field says
``omit_if_none``; where it does not, ``None`` is never sent.
"""

from __future__ import annotations

import dataclasses
import reprlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # pragma: no cover
    from typing_extensions import dataclass_transform

from zpipe._errors import ProtocolError
from zpipe.protocol._message import Message

if TYPE_CHECKING:
    import torch  # annotations only: the protocol imports no torch

Types = tuple[type, ...]
STR: Types = (str,)
INT: Types = (int,)
NUM: Types = (int, float)
MAP: Types = (dict,)
LIST: Types = (list,)
BOOL: Types = (bool,)
OPT_STR: Types = (str, type(None))
OPT_INT: Types = (int, type(None))
OPT_NUM: Types = (int, float, type(None))
OPT_MAP: Types = (dict, type(None))
OPT_LIST: Types = (list, type(None))
OPT_BOOL: Types = (bool, type(None))

# Counters and indices that are never negative, in whichever kind they appear.
NON_NEGATIVE_KEYS = frozenset({"run", "mb", "start", "end", "index"})

# Peer-chosen values in error messages are trimmed: a 1 MiB kind name or a
# deeply nested value must not become a 1 MiB log line or a RecursionError.
_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60
_short.maxlevel = 3


def short_repr(value: Any) -> str:
    return _short.repr(value)


class FieldSchema(NamedTuple):
    """One body field on the wire: the msgpack types it accepts, and whether it must be there."""

    types: Types
    required: bool


Schema = Mapping[str, FieldSchema]


@dataclass(frozen=True)
class WireField:
    """How one dataclass attribute crosses the wire."""

    attr: str
    key: str
    schema: FieldSchema
    omit_if_none: bool

    def encodes(self, value: Any) -> bool:
        """Whether ``value`` goes into the body (an absent optional field does not)."""
        if value is not None or self.schema.required:
            return True
        return type(None) in self.schema.types and not self.omit_if_none


_WIRE = "zpipe.wire"
_REQUIRED: Any = dataclasses.MISSING
_C = TypeVar("_C", bound="WireMessage")


def wire(
    types: Types,
    *,
    default: None = _REQUIRED,
    key: str | None = None,
    omit_if_none: bool = False,
) -> Any:
    """Declare a body field: its msgpack ``types``, and ``key`` where it differs from the name.

    ``default=None`` makes the field optional (``None``: absent). ``omit_if_none``:
    a field whose wire type admits null that senders leave out, rather than send
    as null, when it has no value.
    """
    required = default is _REQUIRED
    meta = {_WIRE: (types, required, key, omit_if_none)}
    if required:
        return dataclasses.field(metadata=meta)
    return dataclasses.field(default=None, metadata=meta)


# Typed messages whose __init__ is the one the dataclass generated (none of their own,
# no __post_init__): only it stores its arguments and nothing else, which
# WireMessage.from_checked relies on to build one without calling it.
_GENERATED_INIT: set[type] = set()


@dataclass_transform(frozen_default=True, kw_only_default=True, field_specifiers=(wire,))
def wire_message(cls: type[_C]) -> type[_C]:
    """Make ``cls`` a typed message: a frozen, keyword-only dataclass of :func:`wire` fields."""
    own_init = "__init__" in vars(cls) or hasattr(cls, "__post_init__")
    made = dataclass(frozen=True, kw_only=True)(cls)
    if not own_init:
        _GENERATED_INIT.add(made)
    return made


def _assembly(cls: type[WireMessage]) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """What :meth:`WireMessage.from_checked` stores for ``cls``: its wire attributes and
    keys, in field order; None unless ``cls(...)`` would only store ``epoch``, the
    tensors (a tensor kind) and those attributes, in that order (then it is called)."""
    if cls not in _GENERATED_INIT:
        return None
    wire_fields = cls.wire_fields()
    attrs = tuple(f.attr for f in wire_fields)
    leading = ("epoch", "tensors") if cls.CARRIES_TENSORS else ("epoch",)
    fields = dataclasses.fields(cls)
    if tuple(f.name for f in fields) != leading + attrs or not all(f.init for f in fields):
        return None
    return attrs, tuple(f.key for f in wire_fields)


def check_body(kind: str, schema: Schema, body: Any) -> dict[str, Any]:
    """``body`` if it fits ``schema``; :class:`ProtocolError` naming the first misfit."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{kind}: body must be a map, got {type(body).__name__}")
    for key in body:
        if key not in schema:
            raise ProtocolError(f"{kind}: unexpected field {short_repr(key)}")
    for key, (types, required) in schema.items():
        if key not in body:
            if required:
                raise ProtocolError(f"{kind}: missing field {key!r}")
            continue
        value = body[key]
        # bool is an int subclass; a flag where a number belongs is a sender bug.
        if isinstance(value, bool) and bool not in types:
            raise ProtocolError(f"{kind}: field {key!r} must not be a bool")
        if not isinstance(value, types):
            names = "/".join("null" if t is type(None) else t.__name__ for t in types)
            raise ProtocolError(
                f"{kind}: field {key!r} must be {names}, got {type(value).__name__}"
            )
        if isinstance(value, int) and key in NON_NEGATIVE_KEYS and value < 0:
            raise ProtocolError(f"{kind}: field {key!r} must be >= 0, got {value}")
    return body


# Values a body field may hold without any nesting: the exact types msgpack decodes
# scalars to (a subclass, a map or a list takes :func:`check_body`'s full path).
PLAIN_LEAF_TYPES = frozenset({str, int, float, bytes, bool, type(None)})


# Body shapes (keys and value types) one flat check remembers: a sender uses a few per
# kind; past this, bodies are still checked, field by field, but not remembered (a
# peer inventing keys cannot grow the table).
MAX_REMEMBERED_SHAPES = 64


def flat_body_check(schema: Schema) -> Callable[[Any], bool]:
    """A one-pass test that ``body`` fits ``schema`` and holds only plain scalars.

    True proves that :func:`check_body` accepts ``body`` unchanged and that it
    nests no deeper than one level; False proves nothing (a nested field, a
    subclass or a misfit): the caller runs :func:`check_body` and the nesting
    check, which accept or name the problem. Precompiled per kind because the
    data plane validates every message against the same few schemas.

    A body's shape (its keys in order, then its values' exact types) decides all
    but the sign of its non-negative fields: the verdict per shape is remembered
    (the fields to look at the sign of, or None for a misfit), so a data message's
    check is one tuple built and looked up in C, not a Python loop over its fields.
    """
    allowed = {
        key: frozenset(t for t in field.types if t in PLAIN_LEAF_TYPES)
        for key, field in schema.items()
    }
    required_count = sum(1 for field in schema.values() if field.required)
    required = frozenset(key for key, field in schema.items() if field.required)
    non_negative = NON_NEGATIVE_KEYS & allowed.keys()
    verdicts: dict[tuple[Any, ...], tuple[str, ...] | None] = {}

    def judge(body: dict[Any, Any]) -> tuple[str, ...] | None:
        """The fields whose sign is left to check, or None when ``body`` misfits."""
        present = 0
        signed = []
        for key, value in body.items():
            types = allowed.get(key)
            kind = type(value)
            if types is None or kind not in types:
                return None
            if kind is int and key in non_negative:
                signed.append(key)
            if key in required:
                present += 1
        return tuple(signed) if present == required_count else None

    def fits(body: Any) -> bool:
        if type(body) is not dict:
            return False
        shape = (*body, *map(type, body.values()))
        try:
            signed = verdicts[shape]
        except KeyError:
            signed = judge(body)
            if len(verdicts) < MAX_REMEMBERED_SHAPES:
                verdicts[shape] = signed
        if signed is None:
            return False
        for key in signed:
            if body[key] < 0:
                return False
        return True

    return fits


_M = TypeVar("_M", bound="WireMessage")
_FIELDS: dict[type, tuple[WireField, ...]] = {}
# per kind, for from_message (every data-plane message is parsed): its schema and the
# one-pass check that proves check_body would accept a body unchanged
_READERS: dict[type, tuple[dict[str, FieldSchema], Callable[[Any], bool]]] = {}
# per kind, for from_checked: its attributes and their wire keys, or None where the
# class's __init__ does more than store what from_message passes it (see _assembly)
_ASSEMBLIES: dict[type, tuple[tuple[str, ...], tuple[str, ...]] | None] = {}


@dataclass(frozen=True, kw_only=True)
class WireMessage:
    """Base of every typed message: one subclass per kind, ``KIND`` its name on the wire.

    ``epoch`` is the plan epoch of the envelope (not a body field).
    """

    KIND: ClassVar[str] = ""
    CARRIES_TENSORS: ClassVar[bool] = False

    epoch: int = 0

    @classmethod
    def wire_fields(cls) -> tuple[WireField, ...]:
        cached = _FIELDS.get(cls)
        if cached is None:
            out = []
            for f in dataclasses.fields(cls):
                declared = f.metadata.get(_WIRE)
                if declared is None:
                    continue
                types, required, key, omit = declared
                out.append(WireField(f.name, key or f.name, FieldSchema(types, required), omit))
            cached = _FIELDS[cls] = tuple(out)
        return cached

    @classmethod
    def schema(cls) -> dict[str, FieldSchema]:
        """The body schema of this kind, wire key -> (types, required)."""
        return {f.key: f.schema for f in cls.wire_fields()}

    def body(self) -> dict[str, Any]:
        """The body as it goes on the wire, in declaration order."""
        body = {}
        for f in self.wire_fields():
            value = getattr(self, f.attr)
            if f.encodes(value):
                body[f.key] = value
        return body

    def to_message(self) -> Message:
        return Message(self.KIND, self.body(), epoch=self.epoch, tensors=self._tensors())

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return ()

    @classmethod
    def from_message(cls: type[_M], message: Message) -> _M:
        """The typed form of ``message``; :class:`ProtocolError` if its body does not fit."""
        if message.kind != cls.KIND:
            raise ProtocolError(f"{cls.__name__} reads {cls.KIND!r} messages, not {message.kind!r}")
        if message.tensors and not cls.CARRIES_TENSORS:
            raise ProtocolError(f"{message.kind}: this kind carries no tensors")
        reader = _READERS.get(cls)
        if reader is None:
            schema = cls.schema()
            reader = _READERS[cls] = (schema, flat_body_check(schema))
        body = dict(message.body)
        if not reader[1](body):  # a nested field, or a misfit: the full check names it
            body = check_body(cls.KIND, reader[0], body)
        values = {f.attr: body.get(f.key) for f in cls.wire_fields()}
        if cls.CARRIES_TENSORS:
            values["tensors"] = tuple(message.tensors)
        return cls(epoch=message.epoch, **values)

    @classmethod
    def from_checked(cls: type[_M], message: Message) -> _M:
        """:meth:`from_message` for a message whose body was already checked against
        this kind's schema: the codec's ``decode`` checks every body against its
        registry (:func:`zpipe.transport.codec.decode_typed` pairs the two), and a
        data-plane message was otherwise checked twice. Anything else goes through
        :meth:`from_message`.

        The instance is built as ``cls(...)`` would build it, in one update of its
        dict: a frozen dataclass's ``__init__`` sets each field through
        ``object.__setattr__``, and a data message is built once per hop.
        """
        if message.kind != cls.KIND:
            raise ProtocolError(f"{cls.__name__} reads {cls.KIND!r} messages, not {message.kind!r}")
        tensors = message.tensors
        if tensors and not cls.CARRIES_TENSORS:
            raise ProtocolError(f"{message.kind}: this kind carries no tensors")
        try:
            assembly = _ASSEMBLIES[cls]
        except KeyError:
            assembly = _ASSEMBLIES[cls] = _assembly(cls)
        body = message.body
        if assembly is None:  # an __init__ that does more than store: call it
            values = {f.attr: body.get(f.key) for f in cls.wire_fields()}
            if cls.CARRIES_TENSORS:
                values["tensors"] = tuple(tensors)
            return cls(epoch=message.epoch, **values)
        # the generated __init__'s order: the bases' epoch (and tensors), then the kind's
        values = (
            {"epoch": message.epoch, "tensors": tuple(tensors)}
            if cls.CARRIES_TENSORS
            else {"epoch": message.epoch}
        )
        attrs, keys = assembly
        values.update(zip(attrs, map(body.get, keys), strict=True))
        built = object.__new__(cls)
        built.__dict__.update(values)
        return built

    @classmethod
    def from_body(cls: type[_M], body: Mapping[str, Any], *, epoch: int = 0) -> _M:
        """The typed form of a body kept apart from its message (a client's request
        that a coordinator's state file keeps); :class:`ProtocolError` if it does not fit."""
        return cls.from_message(Message(cls.KIND, dict(body), epoch=epoch))


@dataclass(frozen=True, kw_only=True)
class TensorMessage(WireMessage):
    """A kind whose frames carry tensors (raw bytes, one frame each).

    Tensors are left out of ``==``: tensors compare elementwise, not as one bool.
    """

    CARRIES_TENSORS: ClassVar[bool] = True

    tensors: tuple[torch.Tensor, ...] = dataclasses.field(default=(), compare=False)

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.tensors)
