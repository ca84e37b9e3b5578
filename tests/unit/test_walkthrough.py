"""The README and docs/ say what is true: the README is a front page (at most 250 lines)
whose two commands are the ones a fresh machine runs; every relative link in it and in
docs/*.md reaches a file, and a heading there when it names one; every path of its
layout map and of docs/design.md's file map exists; and the walkthroughs of one request
(docs/design.md's "One request, hop by hop", the README's short one) name real code:
every `path.py: Name` or `path.py: Class.member` exists in the source, read with `ast`
(nothing is imported), so renaming or moving a hop fails here until the text follows it.

A name resolves as: a module-level function, class or assignment; then, inside a class,
a method, nested class or class-body field (a dataclass field), or an attribute the
class's methods assign on `self` (`self._streams = ...`).
"""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "design.md"
TITLE = "## One request, hop by hop"
SHORT = "## One request, in short"
# `router/server.py: GenerationServicer.Generate`; the name may wrap onto the next line.
NAMED = re.compile(r"`([\w/]+\.py):\s+([A-Za-z_][\w.]*)`")
# `Router._attempt` once its file was named: found in one of the files the section names.
BARE = re.compile(r"`([A-Z_]\w*(?:\.\w+)+)`")
HOP = re.compile(r"^(\d+)\. ", re.MULTILINE)


def _section(page: Path = DESIGN, title: str = TITLE) -> str:
    text = page.read_text()
    assert text.count(title) == 1, f"{page.name}: one {title!r} section expected"
    body = text.split(title, 1)[1]
    return body.split("\n## ", 1)[0]


def _members(node: ast.Module | ast.ClassDef) -> dict[str, ast.AST]:
    """Names defined in a module's or class's own body (and, for a class, on `self`)."""
    found: dict[str, ast.AST] = {}
    for stmt in node.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found[stmt.name] = stmt
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            found[stmt.target.id] = stmt
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = stmt
    if isinstance(node, ast.ClassDef):
        for sub in ast.walk(node):
            targets: list[ast.expr] = []
            if isinstance(sub, ast.Assign):
                targets = [t for tgt in sub.targets for t in _flat(tgt)]
            elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
                targets = [sub.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and _is_self(t.value):
                    found.setdefault(t.attr, sub)
    return found


def _is_self(value: ast.expr) -> bool:
    return isinstance(value, ast.Name) and value.id == "self"


def _flat(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, ast.Tuple | ast.List):
        return [t for elt in target.elts for t in _flat(elt)]
    return [target]


def _missing(path: str, dotted: str) -> str | None:
    """Why `path: dotted` names nothing, or None if it names something."""
    file = ROOT / path
    if not file.is_file():
        return f"{path}: no such file"
    scope: ast.AST = ast.parse(file.read_text(), filename=path)
    for i, part in enumerate(dotted.split(".")):
        if not isinstance(scope, ast.Module | ast.ClassDef):
            return f"{path}: {'.'.join(dotted.split('.')[:i])} has no members to name"
        members = _members(scope)
        if part not in members:
            return f"{path}: no {dotted} ({part!r} not found)"
        scope = members[part]
    return None


def named() -> list[tuple[str, str]]:
    return NAMED.findall(_section())


def test_the_walkthrough_names_hops_in_order() -> None:
    numbers = [int(n) for n in HOP.findall(_section())]
    assert numbers == list(range(1, len(numbers) + 1))
    assert 10 <= len(numbers) <= 20, f"{len(numbers)} hops: keep the map to 10-20"


def test_every_named_hop_exists_in_the_source() -> None:
    names = named()
    assert len(names) >= 30, "the section names its hops as `path.py: Name.method`"
    missing = [why for path, dotted in names if (why := _missing(path, dotted))]
    assert not missing, "design.md 'One request, hop by hop' names code that is gone:\n" + (
        "\n".join(missing)
    )


def test_every_named_file_is_in_the_path_form() -> None:
    spans = re.findall(r"`([^`]*\.py:[^`]*)`", _section())
    assert len(spans) == len(named()), f"not `path.py: Name`: {spans}"


def test_every_bare_class_member_exists_in_a_named_file() -> None:
    files = sorted({path for path, _ in named()})
    bare = BARE.findall(_section())
    assert bare, "the state list names members as `Class.member`"
    missing = [d for d in bare if all(_missing(f, d) for f in files)]
    assert not missing, f"named in the walkthrough, defined in none of its files: {missing}"


def test_a_renamed_hop_is_caught() -> None:
    assert _missing("router/dispatch.py", "Dispatcher.generate") is None
    assert _missing("router/dispatch.py", "Dispatcher._streams") is None  # set on self
    assert _missing("router/dispatch.py", "Progress.kv_ready_at") is None  # a dataclass field
    assert _missing("router/dispatch.py", "Dispatcher.generat") is not None
    assert _missing("router/dispatch.py", "Dispatcher.generate.x") is not None
    assert _missing("router/nowhere.py", "Dispatcher") is not None


def test_the_short_walkthrough_names_hops_that_exist() -> None:
    section = _section(README, SHORT)
    names = NAMED.findall(section)
    assert len(names) >= 10, "the README's short walkthrough names its hops as `path.py: Name`"
    missing = [why for path, dotted in names if (why := _missing(path, dotted))]
    assert not missing, "README 'One request, in short' names code that is gone:\n" + (
        "\n".join(missing)
    )
    assert [int(n) for n in HOP.findall(section)] == list(range(1, 7))


# The front page.

MAX_README_LINES = 250
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def test_the_readme_is_a_front_page() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md is {lines} lines: move detail into docs/"


def test_the_readme_gives_the_two_commands_of_a_fresh_machine() -> None:
    """Exactly two commands to run, each alone in its bash block: the main job on its
    defaults, and the tests (which CI runs too, from a clean clone)."""
    blocks = [body.strip() for lang, body in FENCE.findall(README.read_text()) if lang == "bash"]
    alone = [b for b in blocks if "\n" not in b and b.startswith("scripts/")]
    assert alone == ["scripts/run", "scripts/test"]
    for command in alone:
        script = ROOT / command
        assert script.is_file() and os.access(script, os.X_OK), f"{command}: not an executable"
    assert "exec scripts/test" in (ROOT / ".ci" / "run").read_text()


# Links: every relative link of the README and docs/*.md reaches a file, and its anchor a
# heading of that file, as GitHub names headings.

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.MULTILINE)


def _pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """The text outside fenced code blocks (whose `#` lines are not headings)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits,
    `_` and `-` kept), spaces as `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for heading in HEADING.findall(_prose(page.read_text())):
        base = slug(heading)
        name, n = base, 0
        while name in found:  # GitHub numbers a repeated heading's anchor
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{page.relative_to(ROOT)}: {target}: no such file")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{page.relative_to(ROOT)}: {target}: no heading #{anchor}")
    return broken


def test_every_relative_link_reaches_a_file_and_heading() -> None:
    pages = _pages()
    assert {"design.md", "serving.md", "engine.md", "gpu.md", "deploy.md"} <= {
        p.name for p in pages
    }
    broken = [why for page in pages for why in broken_links(page)]
    assert not broken, "\n".join(broken)


def test_the_readme_links_every_page_of_docs() -> None:
    linked = {
        (README.parent / t.partition("#")[0]).resolve()
        for t in LINK.findall(_prose(README.read_text()))
    }
    unlinked = [p.name for p in _pages()[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not reach: {unlinked}"


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    assert slug("The test suite: `.ci/run` from a fresh clone") == (
        "the-test-suite-cirun-from-a-fresh-clone"
    )
    assert slug("Tensor parallelism on one CPU host: TP=2 against TP=1") == (
        "tensor-parallelism-on-one-cpu-host-tp2-against-tp1"
    )
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## A section\n\n```bash\n# not a heading\n```\n\n"
        "[ok](#a-section) [bad](#not-a-heading) [gone](nowhere.md) [web](https://x.org)\n"
    )
    assert anchors(page) == {"title", "a-section"}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sys.modules[__name__], "ROOT", tmp_path)
        assert broken_links(page) == [
            "page.md: #not-a-heading: no heading #not-a-heading",
            "page.md: nowhere.md: no such file",
        ]


# Maps: every path the README's layout and docs/design.md's file map name exists.

ENTRY = re.compile(r"^( *)(\S.*?)(?:\s{2,}|$)")


def map_paths(block: str) -> list[str]:
    """The paths of a map drawn as an indented tree (two spaces a level; an entry's names,
    comma-separated, before its description). Lines before its first top-level folder,
    and continuation lines (indented past any entry), are prose."""
    paths: list[str] = []
    stack: list[str] = []
    started = False
    for line in block.splitlines():
        m = ENTRY.match(line)
        if not m:
            continue
        depth = len(m.group(1)) // 2
        started = started or (depth == 0 and re.fullmatch(r"[\w./-]+/", m.group(2)) is not None)
        if not started or len(m.group(1)) > 12:
            continue
        del stack[depth:]
        for name in m.group(2).split(", "):
            paths.append("".join(stack) + name)
        if m.group(2).endswith("/") and ", " not in m.group(2):
            stack.append(m.group(2))
    return paths


def _map(page: Path, title: str) -> str:
    blocks = [body for lang, body in FENCE.findall(_section(page, title)) if not lang]
    assert len(blocks) == 1, f"{page.name} {title!r}: one map expected"
    return blocks[0]


def test_every_path_of_the_maps_exists() -> None:
    layout = map_paths(_map(README, "## Layout"))
    assert {"cluster/engine/sched/", "cluster/engine/kernels/", "cluster/engine/model/"} <= set(
        layout
    )
    files = map_paths(_map(DESIGN, "### Every file"))
    assert "cluster/engine/sched/scheduler.py" in files and len(files) > 100
    missing = [p for p in layout + files if not (ROOT / p).exists()]
    assert not missing, f"named in a map, not in the repository: {missing}"
