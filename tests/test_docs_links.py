"""The documentation's references resolve: every relative link in README.md, BENCHMARKS.md and docs/*.md names an
existing file (and, with `#anchor`, a heading of that file), and every `docs/NAME.md` that the code cites names an
existing file (and, when a quoted section name follows it, `docs/design.md, "I4 (rollback)"`, a heading of it,
line breaks inside the quotes read as spaces).

Anchors follow GitHub's heading ids: the heading's text without markup, lower-cased, punctuation other than `-` and
`_` dropped, spaces turned into `-`, and `-1`, `-2`, ... appended to repeats.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from processes import ROOT

DOCUMENTS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")])
CODE_DIRS = ("hf_loopspec", "scripts", "tests")
CODE_SUFFIXES = {".py", ".sh", ".md"}
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_REFERENCE = re.compile(r"docs/([A-Za-z0-9_.-]+\.md)(?:,?\s+\"([^\"]+)\")?")


def prose_lines(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's id of a heading (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The heading ids of the Markdown file `path`."""
    seen: dict[str, int] = {}
    ids = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            ids.add(base if count == 0 else f"{base}-{count}")
    return ids


def headings(path: Path) -> set[str]:
    """The text of every heading of the Markdown file `path`."""
    return {m.group(2) for line in prose_lines(path.read_text(encoding="utf-8")) if (m := HEADING.match(line))}


def broken_links(path: Path) -> list[str]:
    """One message per relative link of the Markdown file `path` whose file or anchor does not exist."""
    problems = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...: not a file of this repository
                continue
            name, _, anchor = target.partition("#")
            resolved = (path.parent / name).resolve() if name else path
            if not resolved.exists():
                problems.append(f"{path.name}: link {target!r}: no file {resolved}")
            elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
                problems.append(f"{path.name}: link {target!r}: no heading with id {anchor!r} in {resolved.name}")
    return problems


def code_references(root: Path) -> list[tuple[Path, str, str]]:
    """(file, document name, quoted section name or '') for every `docs/NAME.md` cited in the code under `root`."""
    found = []
    for folder in CODE_DIRS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in CODE_SUFFIXES or not path.is_file() or path == Path(__file__).resolve():
                continue  # this file's own examples name files that do not exist on purpose
            for name, quoted in CODE_REFERENCE.findall(path.read_text(encoding="utf-8")):
                found.append((path, name, " ".join(quoted.split())))  # a docstring may wrap the section name
    return found


def broken_code_references(root: Path) -> list[str]:
    """One message per `docs/NAME.md` cited in the code under `root` that names no file, or whose quoted section
    name is not a heading of that file."""
    problems = []
    for path, name, section in code_references(root):
        doc, where = root / "docs" / name, path.relative_to(root)
        if not doc.is_file():
            problems.append(f"{where}: cites docs/{name}, which does not exist")
        elif section and section not in headings(doc):
            problems.append(f"{where}: cites section {section!r} of docs/{name}, which has no such heading")
    return problems


def test_the_checks_catch_broken_references(tmp_path):
    """The checks themselves, on a small tree: a missing file, a missing anchor and a missing section are reported
    by name; the existing ones are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## I4 (rollback)\n\n```\n## not a heading\n```\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md) [ok](docs/a.md#i4-rollback) [ok](#top) [web](https://example.com/x.md)\n"
                    "[gone](docs/b.md) [bad](docs/a.md#not-a-heading) `[code](docs/c.md)`\n# Top\n")
    assert broken_links(page) == [
        f"README.md: link 'docs/b.md': no file {(tmp_path / 'docs' / 'b.md').resolve()}",
        "README.md: link 'docs/a.md#not-a-heading': no heading with id 'not-a-heading' in a.md",
    ]
    (tmp_path / "hf_loopspec").mkdir()
    code = '"""See docs/a.md, "I4\n    (rollback)"; docs/a.md "I9"; docs/z.md."""'  # the first wraps inside the name
    (tmp_path / "hf_loopspec" / "m.py").write_text(code)
    assert broken_code_references(tmp_path) == [
        "hf_loopspec/m.py: cites section 'I9' of docs/a.md, which has no such heading",
        "hf_loopspec/m.py: cites docs/z.md, which does not exist",
    ]
    assert slug("Second proposals (`--second-draft-loops`), embedded model") == \
        "second-proposals---second-draft-loops-embedded-model"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert path.is_file()
    assert broken_links(path) == []


def test_docs_cited_in_the_code_exist():
    assert any(section for _, _, section in code_references(ROOT))  # the pattern still finds the code's citations
    assert broken_code_references(ROOT) == []
