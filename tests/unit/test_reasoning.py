"""router/reasoning.py: a reply's `<think>` thoughts apart from its answer, the same whole
or fed delta by delta (a tag split across deltas included), and the tokens that bound the
thoughts for a grammar held after them."""

from __future__ import annotations

import pytest

from cluster.config import REASONING_PARSERS
from cluster.engine.model.model_files import bundled_model_path
from cluster.engine.model.tokenizer import Tokenizer
from cluster.types import FinishReason, InvalidRequestError, RequestId, TokenDelta
from router.openai_reply import ReplyRenderer
from router.openai_request import to_call
from router.reasoning import PARSERS, ReasoningSplit, grammar_bounds

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


def test_a_grammar_after_the_thoughts_takes_the_tags_token_ids() -> None:
    tokenizer = Tokenizer.load(bundled_model_path())
    with pytest.raises(InvalidRequestError, match=r"^response_format: .* \(qwen3\) starts after"):
        grammar_bounds("qwen3", tokenizer, "response_format")  # </think> is several tokens
    assert tokenizer.hf.add_tokens(["<think>", "</think>"]) == 2
    assert grammar_bounds("qwen3", tokenizer, "tool_choice") == (49153, 49152)
    assert grammar_bounds("deepseek_r1", tokenizer, "tool_choice") == (49153, None)


def test_a_streamed_forced_call_comes_after_its_thoughts() -> None:
    # Qwen3's thoughts, then the named call's arguments (the grammar held them): the
    # thoughts stream as reasoning_content, the arguments as the call's deltas.
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    weather = {"type": "function", "function": {"name": "weather", "parameters": city}}
    named = {"type": "function", "function": {"name": "weather"}}
    body = {"model": "m", "messages": [{"role": "user", "content": "Rome?"}], "stream": True,
            "tools": [weather], "tool_choice": named}  # fmt: skip
    call = to_call(body, True, None)
    render = ReplyRenderer(Tokenizer.load(bundled_model_path()), "m", "qwen3", None)
    readers = render.readers(call)
    reply = '<think>Rome is a city.</think>{"city": "Rome"}'
    pieces = [reply[i : i + 3] for i in range(0, len(reply), 3)]
    chunks = [
        render.chunk(call, TokenDelta(RequestId("r"), i, (), piece, finish_reason=(
            FinishReason.STOP if i == len(pieces) - 1 else None)), 0, readers)
        for i, piece in enumerate(pieces)
    ]  # fmt: skip
    deltas = [c["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Rome is a city."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "weather"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Rome"}'
    assert not any(d.get("content") for d in deltas)
    assert chunks[-1]["finish_reason"] == "tool_calls"
