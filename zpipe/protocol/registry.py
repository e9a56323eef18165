"""The set of message kinds a process speaks: one typed class per kind, registered explicitly.

:data:`zpipe.protocol.REGISTRY` holds every kind of zpipe (the lossy ones included)
and is what the codec validates against. Nothing registers itself at import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

from zpipe._errors import ProtocolError
from zpipe.protocol._message import Message
from zpipe.protocol._schema import (
    FieldSchema,
    WireMessage,
    check_body,
    flat_body_check,
    short_repr,
)


class Registry:
    """Kinds by name: their schema, whether they carry tensors, and their class."""

    def __init__(self, classes: Iterable[type[WireMessage]] = ()) -> None:
        self._schemas: dict[str, dict[str, FieldSchema]] = {}
        self._tensor_kinds: set[str] = set()
        self._classes: dict[str, type[WireMessage]] = {}
        # precompiled flat_body_check per kind, built on first use
        self._flat_checks: dict[str, Callable[[object], bool]] = {}
        for cls in classes:
            self.add(cls)

    def add(self, cls: type[WireMessage]) -> None:
        """Register the typed class of one kind; a kind is registered once."""
        if not cls.KIND:
            raise ValueError(f"{cls.__name__} names no KIND")
        if cls.KIND in self._schemas:
            raise ValueError(f"message kind {cls.KIND!r} is already registered")
        self._schemas[cls.KIND] = cls.schema()
        self._flat_checks.pop(cls.KIND, None)
        self._classes[cls.KIND] = cls
        if cls.CARRIES_TENSORS:
            self._tensor_kinds.add(cls.KIND)

    def add_schema(
        self,
        kind: str,
        schema: Mapping[str, tuple[tuple[type, ...], bool]],
        *,
        carries_tensors: bool,
    ) -> None:
        """A kind without a typed class (the deprecated ``codec.register_kinds``).

        Registering a kind again with the same schema is a no-op; with another
        schema it is a programming error.
        """
        given = {key: FieldSchema(*spec) for key, spec in schema.items()}
        known = self._schemas.get(kind)
        if known is not None and known != given:
            raise ValueError(f"message kind {kind!r} is already registered with another schema")
        self._schemas[kind] = given
        self._flat_checks.pop(kind, None)
        if carries_tensors:
            self._tensor_kinds.add(kind)

    @property
    def schemas(self) -> Mapping[str, Mapping[str, FieldSchema]]:
        """Every kind's body schema (a live, read-only view)."""
        return MappingProxyType(self._schemas)

    @property
    def tensor_kinds(self) -> frozenset[str]:
        return frozenset(self._tensor_kinds)

    @property
    def classes(self) -> Mapping[str, type[WireMessage]]:
        return MappingProxyType(self._classes)

    def __contains__(self, kind: object) -> bool:
        return kind in self._schemas

    def carries_tensors(self, kind: str) -> bool:
        return kind in self._tensor_kinds

    def check_body(self, kind: str, body: object) -> dict[str, object]:
        """``body`` if it fits ``kind``'s schema; :class:`ProtocolError` otherwise."""
        schema = self._schemas.get(kind)
        if schema is None:
            raise ProtocolError(f"unknown message kind {short_repr(kind)}")
        return check_body(kind, schema, body)

    def fits_flat(self, kind: str, body: object) -> bool:
        """True when ``body`` fits ``kind``'s schema and holds only plain scalars (one
        precompiled pass); False proves nothing: use :meth:`check_body`."""
        check = self._flat_checks.get(kind)
        if check is None:
            schema = self._schemas.get(kind)
            if schema is None:
                return False
            check = self._flat_checks[kind] = flat_body_check(schema)
        return check(body)

    def parse(self, message: Message) -> WireMessage:
        """The typed form of ``message``; :class:`ProtocolError` if it has none or does not fit."""
        cls = self._classes.get(message.kind)
        if cls is None:
            raise ProtocolError(f"message kind {short_repr(message.kind)} has no typed class")
        return cls.from_message(message)

    def parse_checked(self, message: Message) -> WireMessage:
        """:meth:`parse` for a message whose body this registry already checked (its
        :meth:`check_body` or :meth:`fits_flat` accepted it, as the codec's ``decode``
        does): the body is not checked again. Anything else goes through :meth:`parse`."""
        cls = self._classes.get(message.kind)
        if cls is None:
            raise ProtocolError(f"message kind {short_repr(message.kind)} has no typed class")
        return cls.from_checked(message)
