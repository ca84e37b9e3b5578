"""The README's "One request, hop by hop" names real code: every `path.py: Name` or
`path.py: Class.member` in that section exists in the source, read with `ast` (nothing is
imported), so renaming or moving a hop fails here until the walkthrough follows it.

A name resolves as: a module-level function, class or assignment; then, inside a class,
a method, nested class or class-body field (a dataclass field), or an attribute the
class's methods assign on `self` (`self._streams = ...`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TITLE = "## One request, hop by hop"
# `router/server.py: GenerationServicer.Generate`; the name may wrap onto the next line.
NAMED = re.compile(r"`([\w/]+\.py):\s+([A-Za-z_][\w.]*)`")
# `Router._attempt` once its file was named: found in one of the files the section names.
BARE = re.compile(r"`([A-Z_]\w*(?:\.\w+)+)`")
HOP = re.compile(r"^(\d+)\. ", re.MULTILINE)


def _section() -> str:
    text = (ROOT / "README.md").read_text()
    assert text.count(TITLE) == 1, f"README.md: one {TITLE!r} section expected"
    body = text.split(TITLE, 1)[1]
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
    assert not missing, "README 'One request, hop by hop' names code that is gone:\n" + "\n".join(
        missing
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
