"""Typed reads of a family's config mapping, with errors that name the key and the family.

Every family reads its config through a ConfigReader and calls finish() last, so
a misspelt key ("num_layer") fails loudly instead of silently using a default.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

from zpipe._errors import ModelSpecError

_MISSING: Any = object()


class ConfigReader:
    """Reads keys from one family's config and remembers which ones it read."""

    def __init__(self, config: Mapping[str, Any], *, family: str) -> None:
        self._config = config
        self._family = family
        self._read: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self._config

    def _raw(self, key: str, default: Any) -> Any:
        self._read.add(key)
        if key in self._config:
            return self._config[key]
        if default is _MISSING:
            raise ModelSpecError(
                f"{self._family} config needs the key {key!r}; "
                f"the config has {sorted(self._config) or 'no keys'}"
            )
        return default

    def error(self, key: str, problem: str) -> ModelSpecError:
        return ModelSpecError(f"{self._family} config key {key!r}: {problem}")

    def get_int(self, key: str, *, default: Any = _MISSING, minimum: int | None = None) -> int:
        value = self._raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.error(key, f"must be at least {minimum}, got {value}")
        return value

    def get_float(self, key: str, *, default: Any = _MISSING, positive: bool = False) -> float:
        value = self._raw(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"expected a number, got {value!r}")
        if positive and not value > 0:
            raise self.error(key, f"must be positive, got {value}")
        return float(value)

    def get_str(
        self, key: str, *, default: Any = _MISSING, choices: Collection[str] | None = None
    ) -> str:
        value = self._raw(key, default)
        if not isinstance(value, str):
            raise self.error(key, f"expected a string, got {value!r}")
        if choices is not None and value not in choices:
            raise self.error(key, f"must be one of {sorted(choices)}, got {value!r}")
        return value

    def get_bool(self, key: str, *, default: Any = _MISSING) -> bool:
        value = self._raw(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {value!r}")
        return value

    def get_int_list(
        self, key: str, *, default: Any = _MISSING, min_len: int = 0, minimum: int | None = None
    ) -> list[int]:
        value = self._raw(key, default)
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise self.error(key, f"expected a list of integers, got {value!r}")
        if len(value) < min_len:
            raise self.error(key, f"needs at least {min_len} entries, got {len(value)}")
        if minimum is not None and any(v < minimum for v in value):
            raise self.error(key, f"entries must be at least {minimum}, got {list(value)}")
        return list(value)

    def get_bool_list(self, key: str, *, default: Any = _MISSING) -> list[bool]:
        value = self._raw(key, default)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, bool) for v in value):
            raise self.error(key, f"expected a list of true/false, got {value!r}")
        return list(value)

    def get_str_list(self, key: str, *, default: Any = _MISSING) -> list[str]:
        value = self._raw(key, default)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise self.error(key, f"expected a list of strings, got {value!r}")
        return list(value)

    def get_mapping(self, key: str, *, default: Any = _MISSING) -> dict[str, Any]:
        value = self._raw(key, default)
        if not isinstance(value, Mapping):
            raise self.error(key, f"expected a mapping, got {value!r}")
        return dict(value)

    def finish(self, *, not_applicable: Iterable[str] = (), why: str = "") -> None:
        """Fail on keys nobody read: a typo, or a key of another kind of model."""
        unread = sorted(set(self._config) - self._read)
        if not unread:
            return
        misplaced = [key for key in unread if key in set(not_applicable)]
        if misplaced:
            raise ModelSpecError(
                f"{self._family} config keys {misplaced} do not apply{' ' + why if why else ''}; "
                "remove them"
            )
        raise ModelSpecError(
            f"unknown {self._family} config keys {unread}; known keys are {sorted(self._read)}"
        )
