"""The pages name real files and link only inside the repository.

Every inline-code token in docs/**/*.md and README.md that starts with
``zpipe/``, ``bench/``, ``docs/`` or ``tests/`` names a path that exists; no
Markdown link leaves the repository (no http, nothing outside docs/ from a page
in docs/; README links stay in the repository)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
README = ROOT / "README.md"
ALL = [*PAGES, README] if README.exists() else PAGES

CHECKED_PREFIXES = ("zpipe/", "bench/", "docs/", "tests/")
_FENCE = re.compile(r"(?ms)^[ \t]*(`{3,}|~{3,}).*?^[ \t]*\1[ \t]*$")
_INLINE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
# [text](target "title"), ![alt](target), and reference definitions [id]: target
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^)]*)?\)")
_REF_DEF = re.compile(r"(?m)^[ ]{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_AUTOLINK = re.compile(r"<((?:https?|ftp|mailto):[^>\s]+)>")
_HTML_LINK = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.I)


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return _FENCE.sub("", text)


def _without_inline_code(text: str) -> str:
    return _INLINE.sub("", text)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def code_paths(text: str) -> list[str]:
    """The repository paths ``text`` names as inline code."""
    out = []
    for match in _INLINE.finditer(_prose(text)):
        token = match.group(2).strip()
        if not token.startswith(CHECKED_PREFIXES) or any(c.isspace() for c in token):
            continue
        token = re.sub(r"::.*$", "", token)  # a test id or an object in the file
        token = re.sub(r":\d+(?:-\d+)?$", "", token)  # a line or a line range
        token = token.rstrip(".,;")
        out.append(token)
    return out


def path_exists(token: str) -> bool:
    if any(c in token for c in "*?["):
        return any(ROOT.glob(token))
    return (ROOT / token.rstrip("/")).exists()


def links(text: str) -> list[str]:
    prose = _without_inline_code(_prose(text))
    found = [m.group(1) for m in _LINK.finditer(prose)]
    found += [m.group(1) for m in _REF_DEF.finditer(prose)]
    found += [m.group(1) for m in _AUTOLINK.finditer(prose)]
    found += [m.group(1) for m in _HTML_LINK.finditer(prose)]
    return found


@pytest.mark.parametrize("page", ALL, ids=_rel)
def test_inline_code_paths_exist(page: Path) -> None:
    missing = [t for t in code_paths(page.read_text(encoding="utf-8")) if not path_exists(t)]
    assert not missing, f"{_rel(page)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", ALL, ids=_rel)
def test_links_stay_in_the_repository(page: Path) -> None:
    bad = []
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
            bad.append(f"{target} (leaves the repository)")
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not path:  # an anchor on the same page
            continue
        if path.startswith("/"):
            bad.append(f"{target} (absolute)")
            continue
        resolved = (page.parent / path).resolve()
        home = DOCS if page != README else ROOT
        if not resolved.is_relative_to(home):
            bad.append(f"{target} (outside {_rel(home) if home != ROOT else 'the repository'})")
        elif not resolved.exists():
            bad.append(f"{target} (no such file)")
    assert not bad, f"{_rel(page)}: {bad}"


def test_the_checks_see_paths_and_links() -> None:
    text = (
        "Run `zpipe/cli/reference.py:12` and `tests/unit/docs/x.py::test_a`, not `python -m x`;\n"
        "see [a](guide/a.md#x), [b](https://example.org), ![c](../shared/p.png) and `[d](e)`.\n"
        "```\n`bench/in_a_fence.py` [f](http://in.fence)\n```\n"
        "[ref]: ../outside.md\n"
        '<a href="http://x.org">x</a>\n'
    )
    assert code_paths(text) == ["zpipe/cli/reference.py", "tests/unit/docs/x.py"]
    assert links(text) == [
        "guide/a.md#x",
        "https://example.org",
        "../shared/p.png",
        "../outside.md",
        "http://x.org",
    ]
    assert path_exists("zpipe/cli/*.py") and path_exists("docs/") and not path_exists("zpipe/no")
