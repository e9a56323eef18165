"""Which model factories a process may import and call: the operator decides, never a peer.

The `sequential` and `traced` families import a factory named in the spec
("package.module:callable") and call it with the spec's kwargs: whoever names
the factory chooses code to run. So a factory is loaded only when it is
allowed, and the check happens on the *string*, before anything is imported.

Who is trusted for what (the default):

- Built-in families (transformer, mlp, cnn) import nothing from the spec and
  need no allow-list anywhere.
- zpipe's own example factories (`zpipe.models.examples:*`) are always allowed:
  they only build small modules.
- A spec this process built itself (`ModelSpec(...)`, `ModelSpec.preset(...)`)
  is the process's own choice: the embedding program (a client, a notebook,
  `zpipe train`) may name any factory, as it could just import it.
- A spec received from a peer (`ModelSpec.from_dict(...)`, which is how every
  spec off the wire is read) loads a factory only if this process's operator
  allowed it: with `allow_peer_factories(...)` once at start-up (the
  coordinator and stage entry points do so from `--allow-factory PATTERN` and
  `--allow-factories FILE`), or an explicit `factories=` argument. With no
  allow-list, only zpipe's own examples load.

Patterns: `pkg.module:make` (exactly that callable, dotted attributes allowed)
or `pkg.module:*` (any public callable *defined in* pkg.module: not a name the
module imported, such as `os` or `torch`, and not a dotted path through it).
A file lists one pattern per line; `#` starts a comment.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zpipe._errors import ConfigError, UntrustedCodeError

ALLOW_FLAG = "--allow-factory"
ALLOW_FILE_FLAG = "--allow-factories"
WILDCARD = "*"
# zpipe's own tiny example factories: any process may build them for a peer.
BUILT_IN_PATTERNS = ("zpipe.models.examples:*",)

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")


def split_factory_path(path: str) -> tuple[str, str]:
    """("package.module", "attribute.path") of a factory path; ConfigError when malformed."""
    module, sep, attributes = path.partition(":")
    if not sep or not _DOTTED.match(module) or not _DOTTED.match(attributes):
        raise ConfigError(f"factory must look like 'package.module:callable', got {path!r}")
    return module, attributes


@dataclass(frozen=True)
class FactoryPattern:
    """One allow-list entry: a module and an attribute path, or `*` for the module's own."""

    module: str
    attribute: str  # a dotted attribute path, or WILDCARD

    @classmethod
    def parse(cls, text: str, *, where: str = "") -> FactoryPattern:
        entry = text.strip()
        module, sep, attribute = entry.partition(":")
        valid = (
            bool(sep)
            and bool(_DOTTED.match(module))
            and (attribute == WILDCARD or bool(_DOTTED.match(attribute)))
        )
        if not valid:
            raise ConfigError(
                f"{where or 'allowed factory'} {text!r}: use 'package.module:callable' "
                "or 'package.module:*'"
            )
        return cls(module, attribute)

    def matches(self, module: str, attributes: str) -> bool:
        if module != self.module:
            return False
        if self.attribute == WILDCARD:
            # One public name: a dotted path could walk into an imported module
            # (pkg.module:os.system), which the operator did not name.
            return bool(_NAME.match(attributes))
        return attributes == self.attribute

    def __str__(self) -> str:
        return f"{self.module}:{self.attribute}"


@dataclass(frozen=True)
class FactoryAllowList:
    """The factories this process's operator allows peers to name (see the module doc)."""

    patterns: tuple[FactoryPattern, ...] = ()
    # Where the entries came from, for error messages ("--allow-factory", a file name).
    sources: tuple[str, ...] = ()

    @classmethod
    def of(cls, *entries: str) -> FactoryAllowList:
        """An allow-list of these patterns, e.g. `FactoryAllowList.of("mypkg.models:*")`."""
        patterns = tuple(FactoryPattern.parse(entry, where=ALLOW_FLAG) for entry in entries)
        return cls(patterns, (ALLOW_FLAG,) if entries else ())

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> FactoryAllowList:
        """One pattern per line; blank lines and `#` comments are ignored."""
        file = Path(path)
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{ALLOW_FILE_FLAG} {file}: cannot read it ({exc})") from None
        patterns = []
        for number, line in enumerate(text.splitlines(), start=1):
            entry = line.split("#", 1)[0].strip()
            if entry:
                patterns.append(FactoryPattern.parse(entry, where=f"{file}:{number}"))
        return cls(tuple(patterns), (f"{ALLOW_FILE_FLAG} {file}",))

    @classmethod
    def from_cli(
        cls, patterns: Iterable[str] = (), files: Iterable[str | os.PathLike[str]] = ()
    ) -> FactoryAllowList:
        """The allow-list of `--allow-factory PATTERN` (repeated) and `--allow-factories FILE`."""
        allow = cls.of(*patterns)
        for file in files:
            allow = allow.combined(cls.from_file(file))
        return allow

    def combined(self, other: FactoryAllowList) -> FactoryAllowList:
        return FactoryAllowList(self.patterns + other.patterns, self.sources + other.sources)

    def allows(self, path: str) -> bool:
        """Whether `path` ("pkg.module:callable") may be imported; looks at the string only."""
        try:
            module, attributes = split_factory_path(path)
        except ConfigError:
            return False
        patterns = (*self.patterns, *_BUILT_IN)
        return any(pattern.matches(module, attributes) for pattern in patterns)

    def check(self, path: str, *, family: str) -> None:
        """Raise UntrustedCodeError unless `path` is allowed. Imports nothing."""
        if self.allows(path):
            return
        module = path.partition(":")[0] or "package.module"
        allowed = ", ".join(str(p) for p in (*self.patterns, *_BUILT_IN))
        if self.sources:
            allowed += f" (from {', '.join(self.sources)} and zpipe's own examples)"
        raise UntrustedCodeError(
            f"model factory {path!r} (family {family!r}) is not allowed in this process, "
            "so nothing was imported. The operator of this process can allow it with "
            f"{ALLOW_FLAG} {path} (or {ALLOW_FLAG} '{module}:*'), or a line in the file "
            f"given to {ALLOW_FILE_FLAG}; allowed now: {allowed}"
        )

    def check_defined_in_module(self, path: str, target: Any) -> None:
        """After import: a wildcard match must be defined in its module, not imported there.

        `pkg.module:*` allows the module's own callables; `system` in a module that
        did `from os import system` is os's, not the module's.
        """
        module, attributes = split_factory_path(path)
        exact = any(
            p.attribute != WILDCARD and p.matches(module, attributes)
            for p in (*self.patterns, *_BUILT_IN)
        )
        if exact:
            return
        if getattr(target, "__module__", None) != module:
            raise UntrustedCodeError(
                f"model factory {path!r} is not defined in {module} (it comes from "
                f"{getattr(target, '__module__', 'elsewhere')}); a '{module}:*' pattern "
                f"allows only the module's own callables: name it with {ALLOW_FLAG} {path}"
            )


def add_allow_factory_arguments(parser: argparse.ArgumentParser) -> None:
    """The two flags of a process that builds specs received from peers."""
    parser.add_argument(
        ALLOW_FLAG,
        dest="allow_factory",
        action="append",
        default=[],
        metavar="MODULE:CALLABLE",
        help="a model factory that peers' specs may name (families 'sequential' and "
        "'traced'), or MODULE:* for every callable defined in MODULE; repeatable. "
        f"Without it only {', '.join(BUILT_IN_PATTERNS)} load",
    )
    parser.add_argument(
        ALLOW_FILE_FLAG,
        dest="allow_factories",
        action="append",
        default=[],
        metavar="FILE",
        help=f"a file of allowed model factories, one {ALLOW_FLAG} pattern per line",
    )


def allow_list_from_args(args: argparse.Namespace) -> FactoryAllowList:
    """The allow-list of the flags added by add_allow_factory_arguments (ConfigError if bad)."""
    return FactoryAllowList.from_cli(args.allow_factory, args.allow_factories)


_BUILT_IN = tuple(FactoryPattern.parse(p) for p in BUILT_IN_PATTERNS)

# Allows only zpipe's own examples: what a peer's spec may name when the operator said nothing.
BUILT_IN_ONLY = FactoryAllowList()


class _TrustCaller:
    """The policy for a process's own specs: it may name any factory (it runs its own code)."""

    def allows(self, path: str) -> bool:
        return True

    def check(self, path: str, *, family: str) -> None:
        return None

    def check_defined_in_module(self, path: str, target: Any) -> None:
        return None


TRUST_CALLER = _TrustCaller()
FactoryPolicy = FactoryAllowList | _TrustCaller

_peer_factories: FactoryAllowList = BUILT_IN_ONLY


def allow_peer_factories(allow: FactoryAllowList) -> FactoryAllowList:
    """Set which factories specs received from peers may name in this process; returns
    the previous allow-list. Call it once at start-up of a coordinator or stage."""
    global _peer_factories
    previous, _peer_factories = _peer_factories, allow
    return previous


def peer_factories() -> FactoryAllowList:
    """The allow-list for specs received from peers in this process."""
    return _peer_factories


@contextmanager
def peer_factories_allowed(allow: FactoryAllowList) -> Iterator[None]:
    """Temporarily set the peer allow-list (tests, in-process servers)."""
    previous = allow_peer_factories(allow)
    try:
        yield
    finally:
        allow_peer_factories(previous)


def factory_policy(*, from_peer: bool, factories: FactoryPolicy | None = None) -> FactoryPolicy:
    """The policy for one spec: an explicit one wins; else a peer's spec gets the process's
    peer allow-list and the process's own spec is trusted."""
    if factories is not None:
        return factories
    return _peer_factories if from_peer else TRUST_CALLER
