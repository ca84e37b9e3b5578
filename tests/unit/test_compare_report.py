"""bench compare rebuilds its page section by section: a workload it reran replaces its
section, every other section stays as written, and a new workload is appended."""

from __future__ import annotations

from bench.compare import _sections, merge

PAGE = """# Serving benchmark

Intro.

## chat

old chat table

## loadgen agreement

hand-written

## multi-turn

old multi-turn table
"""


def test_a_rerun_workload_replaces_only_its_own_section() -> None:
    old = _sections(PAGE)
    assert [s.split("\n")[0] for s in old] == ["## chat", "## loadgen agreement", "## multi-turn"]
    merged = merge(old, ["## chat\n\nnew chat table", "## long-prompt\n\nnew"])
    assert merged == [
        "## chat\n\nnew chat table",
        "## loadgen agreement\n\nhand-written",
        "## multi-turn\n\nold multi-turn table",
        "## long-prompt\n\nnew",
    ]
