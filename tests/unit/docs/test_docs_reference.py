"""The generated reference pages list everything the code has: every command and
each of its flags, every registered message kind, every error class."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from zpipe._errors import ZpipeError
from zpipe.cli import COMMANDS
from zpipe.cli import reference as ref
from zpipe.protocol import REGISTRY

ROOT = Path(__file__).resolve().parents[3]
ZPIPE = ROOT / "zpipe"
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def parsers():
    return ref.command_parsers()


@pytest.fixture(scope="module")
def cli_page(parsers):
    return ref.cli_reference(parsers)


def _sections(page: str, level: str) -> dict[str, str]:
    """``page``'s sections at heading ``level`` ('## '), by heading text."""
    parts = re.split(rf"(?m)^{level}(.+)$", page)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def test_every_command_has_a_parser_and_a_section(parsers, cli_page):
    assert list(parsers) == list(COMMANDS)
    sections = _sections(cli_page, "## ")
    assert [name.removeprefix("zpipe ") for name in sections] == list(COMMANDS)


def test_every_flag_of_every_parser_is_listed(parsers, cli_page):
    sections = _sections(cli_page, "## ")
    for name, parser in parsers.items():
        section = sections[f"zpipe {name}"]
        rows = [line for line in section.splitlines() if line.startswith("| `")]
        actions = ref.documented_actions(parser)
        assert actions, name
        assert len(rows) == len(actions), name
        for action in actions:
            spelled = ", ".join(action.option_strings) or str(action.metavar or action.dest)
            assert f"| `{spelled}` |" in section, (name, spelled)
            if action.help:
                first_words = " ".join(str(action.help).split()[:4]).replace("|", "\\|")
                assert first_words in section, (name, spelled)
        if parser.description:
            assert parser.description.split()[0] in section, name


def test_cli_page_shows_defaults_and_metavars(parsers, cli_page):
    section = _sections(cli_page, "## ")["zpipe coordinator"]
    bind = next(a for a in parsers["coordinator"]._actions if "--bind" in a.option_strings)
    assert f"| `--bind` | `{bind.metavar}` | `{bind.default}` |" in section


def test_protocol_page_lists_every_registered_kind():
    page = ref.protocol_reference()
    kinds = re.findall(r"(?m)^### `([^`]+)`", page)
    assert sorted(kinds) == sorted(REGISTRY.classes)
    assert set(REGISTRY.schemas) <= set(REGISTRY.classes) | set(
        re.findall(r"\| `([^`]+)` \| \(no typed class\)", page)
    )
    kind_sections = _sections(page, "### ")
    for kind, cls in REGISTRY.classes.items():
        section = kind_sections[f"`{kind}` {{#kind-{ref._anchor(kind)}}}"]
        for field in cls.wire_fields():
            assert f"| `{field.key}" in section, (kind, field.key)
        conversation = cls.__module__.rsplit(".", 1)[-1]
        assert f"| [`{kind}`](#kind-{ref._anchor(kind)}) | {conversation} |" in page


def _zpipe_error_classes() -> set[type]:
    """Every ZpipeError subclass defined in zpipe, found by importing each module
    that defines a class (read independently of zpipe.cli.reference)."""
    out: set[type] = set()
    for path in ZPIPE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        classes = [
            n.name
            for n in tree.body
            if isinstance(n, ast.ClassDef)
            and any(ast.unparse(b).endswith(("Error", "Timeout", "Exception")) for b in n.bases)
        ]
        if not classes:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(p for p in parts if p != "__init__")
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional dependency
            continue
        for cls_name in classes:
            cls = getattr(module, cls_name, None)
            if isinstance(cls, type) and issubclass(cls, ZpipeError):
                out.add(cls)
    return out


def test_errors_page_lists_every_zpipe_error():
    page = ref.errors_reference()
    headings = set(re.findall(r"(?m)^## (\w+)$", page))
    expected = _zpipe_error_classes()
    assert ZpipeError in expected and len(expected) > 10
    assert {cls.__name__ for cls in expected} <= headings
    tree = page.split("```")[1]
    for cls in expected:
        assert re.search(rf"(?m)(^|── ){cls.__name__}\b", tree), cls.__name__
        doc = ref._own_doc(cls)
        if doc:
            assert doc.split()[0] in page


def test_every_marker_names_a_generator():
    pages = {p.name: p.read_text(encoding="utf-8") for p in (DOCS / "reference").glob("*.md")}
    named = {m.group(1) for text in pages.values() for m in ref.MARKER.finditer(text)}
    assert named == set(ref.GENERATORS)
    for text in pages.values():
        for match in ref.MARKER.finditer(text):
            assert match.group(1) in ref.GENERATORS


def test_expand_replaces_the_marker_once_per_name():
    calls: list[int] = []

    def generate() -> str:
        calls.append(1)
        return "GENERATED"

    ref.GENERATORS["_test"] = generate
    try:
        cache: dict[str, str] = {}
        assert ref.expand("a\n<!-- generated: _test -->\nb", cache) == "a\nGENERATED\nb"
        assert ref.expand("<!--generated:_test-->", cache) == "GENERATED"
        assert calls == [1]
    finally:
        del ref.GENERATORS["_test"]
    with pytest.raises(KeyError):
        ref.expand("<!-- generated: nosuch -->")


def test_rst_roles_become_inline_code():
    text = ref.rst_to_markdown(
        "See :class:`~zpipe.client.InferOptions` and ``x = 1``; :mod:`zpipe.protocol`::\n\n"
        "    code\n\nEnd."
    )
    assert text == (
        "See `zpipe.client.InferOptions` and `x = 1`; `zpipe.protocol`:\n\n    code\n\nEnd."
    )
