"""router/reasoning.py: a reply's `<think>` thoughts apart from its answer, the same whole
or fed delta by delta (a tag split across deltas included)."""

from __future__ import annotations

import pytest

from cluster.config import REASONING_PARSERS
from router.reasoning import PARSERS, ReasoningSplit

CASES = [
    # parser, reply, reasoning, content
    ("qwen3", "<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "\n\nIt is 4."),
    ("qwen3", "It is 4.", None, "It is 4."),  # thinking off: no <think>, all answer
    ("qwen3", "\n<think>a</think>b", "a", "b"),
    ("qwen3", "<think>cut short", "cut short", None),
    ("qwen3", "I use </think> plainly", None, "I use </think> plainly"),
    ("qwen3", "<thinking aloud", None, "<thinking aloud"),
    ("deepseek_r1", "Let me see.</think>It is 4.", "Let me see.", "It is 4."),
    ("deepseek_r1", "<think>Hm</think>4", "Hm", "4"),
    ("deepseek_r1", "still thinking <", "still thinking <", None),
    ("deepseek_r1", "a </thin b</think>c", "a </thin b", "c"),
]


def streamed(parser: str, reply: str, size: int) -> tuple[str | None, str | None]:
    split = ReasoningSplit.of(parser)
    pieces = [reply[i : i + size] for i in range(0, len(reply), size)]
    out = [split.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    reasoning, content = "".join(r for r, _ in out), "".join(c for _, c in out)
    return reasoning or None, content or None


@pytest.mark.parametrize("parser, reply, reasoning, content", CASES)
def test_a_reply_splits_into_reasoning_and_content(
    parser: str, reply: str, reasoning: str | None, content: str | None
) -> None:
    assert ReasoningSplit.of(parser).whole(reply) == (reasoning, content)
    for size in (1, 2, 3, 7):
        assert streamed(parser, reply, size) == (reasoning, content), size


def test_a_tag_split_across_deltas_is_held_until_whole() -> None:
    split = ReasoningSplit.of("deepseek_r1")
    assert split.feed("ok </th") == ("ok ", "")
    assert split.feed("ink>4") == ("", "4")


def test_the_config_names_every_parser() -> None:
    assert set(PARSERS) == set(REASONING_PARSERS)
