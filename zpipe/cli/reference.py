"""The generated reference pages of the documentation site, as Markdown.

``docs/hooks/reference.py`` (an MkDocs hook) calls these while the site is
built, so the pages can never drift from the code: :func:`cli_reference` walks
every command's argparse parser, :func:`protocol_reference` the protocol
registry, :func:`errors_reference` the error classes. Each returns the
Markdown that replaces a page's ``<!-- generated: NAME -->`` marker
(:data:`GENERATORS`). Nothing here runs a command or starts a process.

It lives in ``zpipe.cli`` because it imports every command module's parser,
which only ``zpipe.cli`` may do.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from zpipe.cli import COMMANDS

# --------------------------------------------------------------------------- text


_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`~?([^`<]+?)(?:\s*<[^>]*>)?`")
_DOUBLE = re.compile(r"``(.+?)``")


def rst_to_markdown(text: str) -> str:
    """A docstring's reStructuredText, good enough as Markdown: roles and double
    backquotes become inline code, ``::`` (a literal block follows) becomes ``:``.

    An indented literal block after a blank line is a code block in Markdown too.
    """
    text = inspect.cleandoc(text)
    text = _ROLE.sub(lambda m: f"`{m.group(1).strip()}`", text)
    text = _DOUBLE.sub(lambda m: f"`{m.group(1)}`", text)
    text = re.sub(r"(?m)\s*::$", ":", text)
    return text


def _cell(text: str) -> str:
    """``text`` fit for one cell of a Markdown table."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: str) -> str:
    """``text`` as inline code (a backquote inside it widens the fence)."""
    text = str(text)
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _anchor(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _own_doc(obj: Any) -> str:
    """``obj``'s own docstring ('' if it has none; a dataclass's generated
    signature is not a docstring)."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    if not doc:
        return ""
    if isinstance(obj, type) and doc.startswith(f"{obj.__name__}("):
        return ""
    return doc


# --------------------------------------------------------------------------- commands


def command_parser(name: str) -> argparse.ArgumentParser:
    """The argparse parser of the command ``python -m zpipe NAME``."""
    module = importlib.import_module(COMMANDS[name].module)
    build = getattr(module, "build_parser", None) or getattr(module, "_parser", None)
    if build is None:
        raise LookupError(f"{module.__name__} has no build_parser()")
    parser = build()
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"{module.__name__}.build_parser() returned {type(parser).__name__}")
    return parser


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command the dispatcher (:data:`zpipe.cli.COMMANDS`) knows, with its parser."""
    return {name: command_parser(name) for name in COMMANDS}


def documented_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The arguments of ``parser`` a user can give (``--help`` left out)."""
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def _groups(parser: argparse.ArgumentParser) -> Iterator[tuple[str, list[argparse.Action]]]:
    """``parser``'s arguments by group, in the order ``--help`` shows them."""
    seen: set[int] = set()
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if not isinstance(a, argparse._HelpAction) and id(a) not in seen
        ]
        seen.update(id(a) for a in actions)
        if actions:
            yield group.title or "arguments", actions
    rest = [a for a in documented_actions(parser) if id(a) not in seen]
    if rest:
        yield "other arguments", rest


def _flag_name(action: argparse.Action) -> str:
    if action.option_strings:
        return ", ".join(action.option_strings)
    return str(action.metavar or action.dest)


def _metavar(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.metavar is not None:
        metavar = action.metavar
        text = " ".join(metavar) if isinstance(metavar, tuple) else str(metavar)
    elif action.choices is not None:
        text = "{" + ",".join(str(c) for c in action.choices) + "}"
    elif action.option_strings:
        text = action.dest.upper()
    else:
        text = action.dest
    if action.nargs in ("+", "*"):
        text += " ..."
    elif action.nargs == "?":
        text = f"[{text}]"
    elif isinstance(action.nargs, int) and action.nargs > 1:
        text = " ".join([text] * action.nargs)
    return text


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    default = action.default
    if default is None or default is argparse.SUPPRESS:
        return ""
    if action.nargs == 0:  # a switch: giving it is the point
        return ""
    if isinstance(default, (list, tuple)):
        return " ".join(str(d) for d in default)
    return str(default)


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if action.help is None or action.help is argparse.SUPPRESS:
        return ""
    text = str(action.help)
    if "%" in text:
        try:
            text = argparse.HelpFormatter(parser.prog)._expand_help(action)
        except (KeyError, TypeError, ValueError):
            pass
    if action.choices is not None and action.metavar is not None:
        text += " (one of: " + ", ".join(str(c) for c in action.choices) + ")"
    return text


def cli_reference(parsers: dict[str, argparse.ArgumentParser] | None = None) -> str:
    """Markdown: one section per command, its description and a table of its flags."""
    parsers = command_parsers() if parsers is None else parsers
    out = [
        "| command | what it does |",
        "|---|---|",
    ]
    for name in parsers:
        summary = COMMANDS[name].summary if name in COMMANDS else ""
        out.append(f"| [{_code(name)}](#{_anchor('zpipe ' + name)}) | {_cell(summary)} |")
    for name, parser in parsers.items():
        out += ["", f"## zpipe {name}", ""]
        out += [f"```text\n{parser.format_usage().strip()}\n```", ""]
        if parser.description:
            out += [rst_to_markdown(parser.description), ""]
        for title, actions in _groups(parser):
            out += [f"**{title[0].upper()}{title[1:]}**", ""]
            out += ["| flag | value | default | what it does |", "|---|---|---|---|"]
            for action in actions:
                metavar = _metavar(action)
                default = _default(action)
                out.append(
                    f"| {_code(_flag_name(action))} | {_code(metavar) if metavar else ''} "
                    f"| {_code(' '.join(default.split())) if default else ''} "
                    f"| {_cell(_help(parser, action))} |"
                )
            out.append("")
        if parser.epilog:
            out += ["```text", textwrap.dedent(parser.epilog).strip("\n"), "```", ""]
    return "\n".join(out).rstrip() + "\n"


# --------------------------------------------------------------------------- protocol


def _wire_types(types: Iterable[type]) -> str:
    names = {"dict": "map", "list": "list", "NoneType": "null", "float": "float"}
    return " / ".join(names.get(t.__name__, t.__name__) for t in types)


def protocol_reference() -> str:
    """Markdown: every registered message kind, by conversation, with its fields."""
    from zpipe.protocol import CONVERSATIONS, REGISTRY

    out = ["| kind | conversation | class | tensors |", "|---|---|---|---|"]
    by_module: dict[str, list[str]] = {}
    for kind, cls in REGISTRY.classes.items():
        by_module.setdefault(cls.__module__, []).append(kind)
        conversation = cls.__module__.rsplit(".", 1)[-1]
        out.append(
            f"| [{_code(kind)}](#kind-{_anchor(kind)}) | {conversation} "
            f"| {_code(cls.__name__)} | {'yes' if cls.CARRIES_TENSORS else ''} |"
        )
    untyped = [kind for kind in REGISTRY.schemas if kind not in REGISTRY.classes]
    for kind in untyped:
        out.append(f"| {_code(kind)} | (no typed class) | | |")
    modules = [m.__name__ for m in CONVERSATIONS]
    modules += [m for m in by_module if m not in modules]
    for module_name in modules:
        module = sys.modules[module_name]
        conversation = module_name.rsplit(".", 1)[-1]
        out += ["", f"## {conversation}", ""]
        out += [f"Module {_code(module_name)}.", ""]
        doc = _own_doc(module)
        if doc:
            out += [rst_to_markdown(doc), ""]
        for kind in by_module.get(module_name, []):
            out += _kind_section(kind, REGISTRY.classes[kind])
    return "\n".join(out).rstrip() + "\n"


def _kind_section(kind: str, cls: Any) -> list[str]:
    import dataclasses

    annotations = {f.name: f.type for f in dataclasses.fields(cls)}
    tensors = ", carries tensors" if cls.CARRIES_TENSORS else ""
    out = ["", f"### {_code(kind)} {{#kind-{_anchor(kind)}}}", ""]
    out += [f"Class {_code(cls.__module__ + '.' + cls.__name__)}{tensors}.", ""]
    doc = _own_doc(cls)
    if doc:
        out += [rst_to_markdown(doc), ""]
    fields = cls.wire_fields()
    if not fields:
        out += ["No body fields.", ""]
        return out
    out += ["| field | wire type | Python type | required |", "|---|---|---|---|"]
    for f in fields:
        key = f.key if f.key == f.attr else f"{f.key} (attribute {f.attr})"
        if f.schema.required:
            required = "yes"
        elif f.encodes(None):
            required = "no (None: sent as null)"
        else:
            required = "no (None: left out)"
        annotation = str(annotations.get(f.attr, ""))
        out.append(
            f"| {_code(key)} | {_wire_types(f.schema.types)} "
            f"| {_code(annotation) if annotation else ''} | {required} |"
        )
    out.append("")
    return out


# --------------------------------------------------------------------------- errors

_ZPIPE = Path(__file__).resolve().parents[1]


def error_modules() -> list[str]:
    """Every zpipe module that defines a subclass of ``ZpipeError``, found by reading
    the source (a class whose base is named ``ZpipeError`` or one found so far), so
    only those modules are imported."""
    trees = {}
    for path in sorted(_ZPIPE.rglob("*.py")):
        parts = path.relative_to(_ZPIPE.parent).with_suffix("").parts
        module = ".".join(p for p in parts if p != "__init__")
        trees[module] = ast.parse(path.read_text(encoding="utf-8"))
    names = {"ZpipeError"}
    found: set[str] = set()
    size = -1
    while size != len(names):
        size = len(names)
        for module, tree in trees.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and any(
                    ast.unparse(b).rsplit(".", 1)[-1] in names for b in node.bases
                ):
                    names.add(node.name)
                    found.add(module)
    return sorted(found)


def error_classes() -> list[type]:
    """:class:`~zpipe._errors.ZpipeError` and every subclass of it in zpipe, depth first."""
    from zpipe._errors import ZpipeError

    for module in error_modules():
        try:
            importlib.import_module(module)
        except ImportError:  # an optional dependency (flwr): its errors are left out
            continue
    out: list[type] = []

    def walk(cls: type) -> None:
        if cls in out:
            return
        out.append(cls)
        for sub in _subclasses(cls):
            walk(sub)

    walk(ZpipeError)
    return out


def _error_sort_key(cls: type) -> tuple[int, str]:
    return (0 if cls.__module__ == "zpipe._errors" else 1, cls.__name__)


def _subclasses(cls: type) -> list[type]:
    """``cls``'s direct subclasses: those of ``zpipe._errors`` first, then by name."""
    subs: list[type] = cls.__subclasses__()
    return sorted(subs, key=_error_sort_key)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__name__}"


def errors_reference() -> str:
    """Markdown: the error tree drawn from the classes, then each class's docstring."""
    from zpipe._errors import ZpipeError

    classes = error_classes()
    lines: list[str] = []

    def draw(cls: type, prefix: str, last: bool, top: bool) -> None:
        where = "" if cls.__module__ == "zpipe._errors" else f"   ({cls.__module__})"
        also = [
            b.__name__
            for b in cls.__bases__
            if not issubclass(b, ZpipeError) and b is not Exception
        ]
        extra = f"   also a {', '.join(also)}" if also else ""
        branch = "" if top else ("└── " if last else "├── ")
        lines.append(f"{prefix}{branch}{cls.__name__}{extra}{where}")
        subs = _subclasses(cls)
        child_prefix = prefix if top else prefix + ("    " if last else "│   ")
        for i, sub in enumerate(subs):
            draw(sub, child_prefix, i == len(subs) - 1, False)

    draw(ZpipeError, "", True, True)
    out = ["```text", *lines, "```", ""]
    for cls in classes:
        out += [f"## {cls.__name__}", ""]
        bases = ", ".join(_code(b.__name__) for b in cls.__bases__)
        out += [f"{_code(_qualname(cls))}, a subclass of {bases}.", ""]
        doc = _own_doc(cls)
        if doc:
            out += [rst_to_markdown(doc), ""]
    return "\n".join(out).rstrip() + "\n"


# --------------------------------------------------------------------------- pages

GENERATORS: dict[str, Callable[[], str]] = {
    "cli": cli_reference,
    "protocol": protocol_reference,
    "errors": errors_reference,
}

MARKER = re.compile(r"<!--\s*generated:\s*([a-z_]+)\s*-->")


def expand(markdown: str, cache: dict[str, str] | None = None) -> str:
    """``markdown`` with each ``<!-- generated: NAME -->`` marker replaced by its page."""
    cache = {} if cache is None else cache

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise KeyError(f"no generated reference named {name!r} (known: {sorted(GENERATORS)})")
        if name not in cache:
            cache[name] = GENERATORS[name]()
        return cache[name]

    return MARKER.sub(replace, markdown)
