"""The documentation travels with the code: every link in ``README.md`` and ``docs/*.md``
leads somewhere a user's clone of the repository has, and nothing the repository tracks cites
what a clone lacks.

- a relative link (``[text](docs/ws-protocol.md)``, ``[text](#anchor)``,
  ``[text](peers.md#pairing)``) names a file or directory inside the repository, and its
  ``#anchor`` names a heading of the Markdown file it points to, slugged as GitHub does;
- a Markdown file named in a code span (``sessions-and-remotes.md``) exists in the
  repository, next to the document or from its root;
- nothing points at the product specification, which lives beside the repository, not in it;
- ``docs/operating.md`` names every setting ``dispatch/settings.py`` reads;
- no git-tracked text file (code, comments, templates, docs, tests, Makefile, CI) cites the
  product specification, its numbered sections, the house-rules file or an issue number, and
  every ``docs/<file>.md#anchor`` it cites names an existing file and heading. A reader of a
  clone can follow a citation only to something the clone has.

Links inside fenced code blocks and code spans are not links; ``http(s)://`` and
``mailto:`` links are not checked (no network in a unit test).
"""

from __future__ import annotations

import ast
import re
import subprocess
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target), with an optional "title"; <target> allowed.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HREF = re.compile(r"""<a\s[^>]*href=["']([^"']+)["']""", re.IGNORECASE)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, …
MARKDOWN_FILE = re.compile(r"^[\w./-]+\.md$")
SPEC = re.compile(r"shared[/]spec\b")
# Citations of what the repository does not contain: the product specification (by path or by
# a section sign), the house-rules file, an issue number. The patterns are spelled so that this
# file does not match them itself. Sections of a public standard (RFC 6750 section 3.1, with
# the sign too) may be cited.
OUTSIDE_CITATION = re.compile(r"spec[/]|shared[/]spec|\xa7|(?-i:CONVENTION[S])|\bissues? #?\d+", re.IGNORECASE)
RFC_SECTION = re.compile(r"RFC ?\d+,? ?(section |\xa7 ?)[\d.]+", re.IGNORECASE)
DOCS_CITATION = re.compile(r"docs/([\w.-]+\.md)(?:#([\w-]+))?")
# A heading cited by its title in quotes, after the document, a comma or an anchor (a second
# heading): the anchor form is checked, this one is not. Matched against a line joined with the
# start of the next one, so that a citation wrapped between the file and the title is seen too.
QUOTED_CITATION = re.compile(r"(?:docs/[\w.-]+|bench/README)\.md(?:#[\w-]+)?(?:,\s*|\s+)[\"\u201c]")
# A comment's marker at the start of a line (``#``, ``//``, ``/*``, ``*``), with the indentation
# around it.
COMMENT_START = re.compile(r"^\s*(?:#+|//+|/?\*+)\s*")
# Code followed by a comment on the same line: the next line is code, not the comment's words.
TRAILING_COMMENT = re.compile(r"\S\s+(?:#|//)\s")
NOT_SCANNED = ("node_modules/", ".venv/", "var/")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line outside fenced code blocks."""
    lines: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        opened = FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = None
            continue
        if opened:
            fence = opened.group(1)
            continue
        lines.append((number, line))
    return lines


def without_code_spans(line: str) -> str:
    return CODE_SPAN.sub(" ", line)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text (code spans, links and emphasis reduced
    to their words, HTML tags dropped), lower-cased, punctuation removed (letters, digits,
    ``_``, ``-`` and spaces kept), each space a ``-``."""
    text = CODE_SPAN.sub(lambda match: match.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"(\*\*|__|\*)", "", text)
    text = unicodedata.normalize("NFC", text).strip().lower()
    text = "".join(char for char in text if char in " -_" or unicodedata.category(char)[0] in "LMN")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, repeated headings numbered ``-1``, ``-2``…"""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        matched = HEADING.match(line)
        if not matched:
            continue
        slug = github_slug(matched.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """``(line number, target)`` of every link of a Markdown file outside code."""
    found: list[tuple[int, str]] = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        prose = without_code_spans(line)
        definition = REFERENCE_DEFINITION.match(prose)
        if definition:
            found.append((number, definition.group(1)))
        found += [(number, target) for target in INLINE_LINK.findall(prose)]
        found += [(number, target) for target in HREF.findall(prose)]
    return found


def broken_link(document: Path, target: str, root: Path = ROOT) -> str | None:
    """Why ``target`` (a link of ``document``) leads nowhere in the repository at ``root``,
    or ``None``."""
    if not target or EXTERNAL.match(target):
        return None
    location, _, anchor = target.partition("#")
    destination = document if not location else (document.parent / unquote(location)).resolve()
    if not destination.is_relative_to(root):
        return f"{target}: outside the repository (a user's clone does not have it)"
    if not destination.exists():
        return f"{target}: no such file in the repository"
    if anchor and destination.suffix == ".md" and unquote(anchor) not in anchors(destination):
        return f"{target}: no heading '#{anchor}' in {destination.relative_to(root)}"
    return None


def missing_markdown_mentions(document: Path, root: Path = ROOT) -> list[str]:
    """Markdown files named in code spans of ``document`` that the repository at ``root`` lacks."""
    missing: list[str] = []
    for number, line in prose_lines(document.read_text(encoding="utf-8")):
        for _, name in CODE_SPAN.findall(line):
            name = name.strip()
            if not MARKDOWN_FILE.match(name):
                continue
            if not any((base / name).exists() for base in (document.parent, root)):
                missing.append(f"line {number}: `{name}` is not in the repository")
    return missing


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("document", DOCUMENTS, ids=_id)
def test_every_relative_link_resolves_to_a_file_and_heading(document: Path) -> None:
    broken = [f"line {number}: {why}" for number, target in links(document) if (why := broken_link(document, target))]
    assert broken == [], f"{_id(document)} has broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("document", DOCUMENTS, ids=_id)
def test_markdown_files_named_in_code_exist(document: Path) -> None:
    missing = missing_markdown_mentions(document)
    assert missing == [], f"{_id(document)} names files a clone does not have:\n" + "\n".join(missing)


@pytest.mark.parametrize("document", DOCUMENTS, ids=_id)
def test_nothing_points_at_the_specification_outside_the_repository(document: Path) -> None:
    found = [
        f"line {n}: {line.strip()}" for n, line in enumerate(document.read_text().splitlines(), 1) if SPEC.search(line)
    ]
    assert found == [], (
        f"{_id(document)} points at the product specification, which users' clones do not have:\n" + "\n".join(found)
    )


def tracked_text_files(root: Path = ROOT) -> list[str]:
    """The repository's git-tracked files that are text (paths relative to ``root``), minus
    installed packages and runtime data."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    names = [name for name in listed.decode().split("\0") if name and not name.startswith(NOT_SCANNED)]
    return [name for name in names if (root / name).is_file() and _text(root / name) is not None]


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def outside_citations(names: list[str], root: Path = ROOT) -> list[str]:
    """``file:line: text`` of every line of ``names`` that cites the specification, its
    sections, the house-rules file or an issue number."""
    found: list[str] = []
    for name in names:
        text = _text(root / name) or ""
        for number, line in enumerate(text.splitlines(), start=1):
            if OUTSIDE_CITATION.search(RFC_SECTION.sub(" ", line)):
                found.append(f"{name}:{number}: {line.strip()[:160]}")
    return found


def broken_docs_citations(names: list[str], root: Path = ROOT) -> list[str]:
    """``file:line: docs/<file>.md#anchor`` of every citation in ``names`` whose document or
    heading does not exist (anchors slugged as GitHub does), and of every heading cited by
    its title in quotes instead of its anchor."""
    found: list[str] = []
    headings: dict[str, set[str]] = {}
    for name in names:
        text = _text(root / name) or ""
        for number, line in enumerate(text.splitlines(), start=1):
            for document, anchor in DOCS_CITATION.findall(line):
                target = root / "docs" / document
                if not target.is_file():
                    found.append(f"{name}:{number}: docs/{document}: no such document")
                elif anchor and anchor not in headings.setdefault(document, anchors(target)):
                    found.append(f"{name}:{number}: docs/{document}#{anchor}: no such heading")
        for number in quoted_citations(text):
            found.append(f"{name}:{number}: a heading cited by its title: cite docs/<file>.md#<anchor>")
    return found


def continuation(line: str, following: str) -> str:
    """``following`` as the rest of ``line``'s sentence: its comment marker and indentation
    dropped, or nothing when it cannot go on with it (a comment line followed by code, code
    with a trailing comment followed by more code)."""
    if COMMENT_START.match(line) and not COMMENT_START.match(following):
        return ""
    if not COMMENT_START.match(line) and TRAILING_COMMENT.search(line):
        return ""
    return COMMENT_START.sub("", following, count=1).lstrip()


def quoted_citations(text: str) -> list[int]:
    """Numbers of the lines of ``text`` where a citation of a heading by its quoted title
    starts, including one whose title is on the next line (comment markers and indentation
    of that line skipped)."""
    lines = text.splitlines()
    found: list[int] = []
    for index, line in enumerate(lines):
        following = lines[index + 1] if index + 1 < len(lines) else ""
        joined = f"{line} {continuation(line, following)}"
        # A match starting on the next line is that line's, found when it is joined in turn.
        if any(match.start() <= len(line) for match in QUOTED_CITATION.finditer(joined)):
            found.append(index + 1)
    return found


@pytest.fixture(scope="module")
def tracked() -> list[str]:
    try:
        return tracked_text_files()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: nothing to list the tracked files with")


def test_nothing_cites_what_the_repository_does_not_contain(tracked: list[str]) -> None:
    found = outside_citations(tracked)
    assert not found, (
        "these lines cite the product specification, its sections, the house-rules file or an issue "
        "number, which a clone does not have; cite the docs/*.md section that says the rule (add one "
        "if none does) or say why in words:\n" + "\n".join(found)
    )


def test_every_docs_citation_names_a_file_and_heading(tracked: list[str]) -> None:
    found = broken_docs_citations(tracked)
    assert not found, "these docs/*.md citations lead nowhere:\n" + "\n".join(found)


def test_the_readme_links_to_the_user_documentation() -> None:
    targets = {target.partition("#")[0] for _, target in links(ROOT / "README.md")}
    assert "docs/README.md" in targets, "README.md should link to the documentation index, docs/README.md"


def settings_read() -> set[str]:
    """The environment variables ``dispatch/settings.py`` reads through ``core.conf``'s
    ``env_*`` helpers (their first argument)."""
    tree = ast.parse((ROOT / "dispatch" / "settings.py").read_text(encoding="utf-8"))
    return {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id.startswith("env_")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    }


def test_the_operating_guide_names_every_setting() -> None:
    text = (ROOT / "docs" / "operating.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", text))
    read = settings_read()
    assert len(read) > 30, read
    missing = sorted(read - named)
    assert missing == [], f"docs/operating.md does not describe these settings: {missing}"


# --- the checker itself -------------------------------------------------------------------------


def test_github_slugs() -> None:
    assert github_slug("Several processes (PostgreSQL + Redis)") == "several-processes-postgresql--redis"
    assert github_slug("`/healthz`") == "healthz"
    assert github_slug("The `remote-call` action") == "the-remote-call-action"
    assert github_slug("**Bold** and [a link](x.md)") == "bold-and-a-link"
    assert github_slug("Envelope: `{type, id}`") == "envelope-type-id"
    assert github_slug("snake_case stays") == "snake_case-stays"


def test_the_checker_finds_broken_links_and_ignores_code(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "README.md").write_text("# Read me\n", encoding="utf-8")
    sample = root / "docs" / "sample.md"
    sample.write_text(
        "# Title\n\n## Title\n\n"
        "[ok](#title) [ok](#title-1) [bad](#nope) [file](../README.md#read-me) [gone](missing.md)\n"
        "[out](../../outside.md) `[not a link](missing.md)` [web](https://example.org/x.md)\n"
        "```\n[in a fence](missing.md)\n# not a heading\n```\n"
        "Read `sessions-and-remotes.md` and `README.md`.\n",
        encoding="utf-8",
    )
    (tmp_path / "outside.md").write_text("# Outside\n", encoding="utf-8")
    assert anchors(sample) == {"title", "title-1"}
    problems = [broken_link(sample, target, root) for _, target in links(sample)]
    assert [problem.split(":")[0] for problem in problems if problem] == ["#nope", "missing.md", "../../outside.md"]
    assert missing_markdown_mentions(sample, root) == ["line 11: `sessions-and-remotes.md` is not in the repository"]


def test_the_citation_checker_finds_outside_and_broken_citations(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Close codes\n", encoding="utf-8")
    # Spelled in pieces so that this file does not cite them itself.
    sign, spec, issue, rules, docs = "\xa7", "spec" + "/", "issue" + " 12", "CONVEN" + "TIONS", "docs" + "/"
    bench = "bench" + "/README"
    bad = tmp_path / "bad.py"
    bad.write_text(
        f"# The limit ({spec}agents.md).\n"
        f"# Ordering (peers.md {sign}6).\n"
        f"# Kept for {issue}, item 3.\n"
        f"# See {rules}.md.\n"
        f"# Closes 4401 ({docs}guide.md#close-codes), bearer per RFC 6750 {sign}3.1.\n"
        f"# Wrong: {docs}guide.md#nope and {docs}gone.md.\n"
        f'# By title: {docs}guide.md "Close codes".\n'
        f'# And: ({docs}guide.md, "Close codes").\n'
        f"# Wrapped: the close code ({docs}guide.md\n"
        f'#   "Close codes").\n'
        f'# A second heading by title: ({docs}guide.md#close-codes, "Guide").\n'
        f'# The benchmarks ({bench}.md, "Goals").\n'
        f'def f():\n    """In a docstring ({docs}guide.md#close-codes,\n    "Guide")."""\n'
        f"// In C: {docs}guide.md\n"
        f'// "Close codes".\n'
        f"/* In a block: {docs}guide.md\n"
        f" * \u201cClose codes\u201d. */\n",
        encoding="utf-8",
    )
    good = tmp_path / "good.py"
    good.write_text(
        f"# The rule: {docs}guide.md#close-codes; RFC 6750 section 3.1; issued 3 tokens.\n"
        f'NAMES = [\n    "close",  # {docs}guide.md#close-codes\n    "open",\n]\n'
        f"# The end of a comment ({docs}guide.md#guide)\n"
        f'print("a string, not the comment\'s title")\n',
        encoding="utf-8",
    )
    (tmp_path / "image.png").write_bytes(b"\x89PNG\0" + spec.encode())
    names = ["bad.py", "good.py", "image.png"]
    assert [entry.split(":")[1] for entry in outside_citations(names, tmp_path)] == ["1", "2", "3", "4"]
    assert broken_docs_citations(names, tmp_path) == [
        f"bad.py:6: {docs}guide.md#nope: no such heading",
        f"bad.py:6: {docs}gone.md: no such document",
        "bad.py:7: a heading cited by its title: cite docs/<file>.md#<anchor>",
        "bad.py:8: a heading cited by its title: cite docs/<file>.md#<anchor>",
        "bad.py:9: a heading cited by its title: cite docs/<file>.md#<anchor>",
        "bad.py:11: a heading cited by its title: cite docs/<file>.md#<anchor>",
        "bad.py:12: a heading cited by its title: cite docs/<file>.md#<anchor>",
        "bad.py:14: a heading cited by its title: cite docs/<file>.md#<anchor>",
        "bad.py:16: a heading cited by its title: cite docs/<file>.md#<anchor>",
        "bad.py:18: a heading cited by its title: cite docs/<file>.md#<anchor>",
    ]
    assert outside_citations(["good.py"], tmp_path) == broken_docs_citations(["good.py"], tmp_path) == []
