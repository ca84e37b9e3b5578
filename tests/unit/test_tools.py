"""router/tools.py: tools and tool_choice checked, the forcing schema, the reply parsers."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from cluster.types import InvalidRequestError
from router.tools import (
    CallStream,
    HermesStream,
    hermes,
    llama3_json,
    parser_for,
    read_tools,
    with_tool_prompt,
)

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}}


def test_hermes_blocks_become_calls_and_the_rest_stays_content() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n' \
        '</tool_call>\n<tool_call>{"name": "time", "arguments": {}}</tool_call>'  # fmt: skip
    content, calls = hermes(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Oslo"}), ("time", {}),
    ]  # fmt: skip
    assert hermes("no calls here") == ("no calls here", [])


def test_llama3_json_is_a_call_only_when_the_reply_is_one() -> None:
    content, calls = llama3_json('{"name": "weather", "parameters": {"city": "Rome"}}')
    assert content is None and calls[0].name == "weather"
    assert llama3_json("The weather is fine.") == ("The weather is fine.", [])


def test_the_parser_is_chosen_by_the_template() -> None:
    assert parser_for("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert parser_for("{{ tools }} <|python_tag|>") == "llama3_json"
    # A template that renders no tools gets the default tool prompt, in Hermes' format.
    assert parser_for("{% for m in messages %}{{ m.content }}{% endfor %}") == "hermes"
    assert parser_for("{{ tools }}") is None  # its own format, one we do not read


def test_the_default_tool_prompt_joins_the_system_message_or_leads() -> None:
    tools = [WEATHER]
    alone = with_tool_prompt([{"role": "user", "content": "Hi"}], tools)
    assert [m["role"] for m in alone] == ["system", "user"]
    assert json.dumps(WEATHER) in alone[0]["content"] and "<tool_call>" in alone[0]["content"]
    joined = with_tool_prompt([{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hi"}], tools)  # fmt: skip
    assert [m["role"] for m in joined] == ["system", "user"]
    assert joined[0]["content"].startswith("Be brief.\n\n# Tools")


def test_required_forces_a_list_of_the_given_calls_and_named_its_arguments() -> None:
    required = read_tools([WEATHER, TIME], "required", False)
    assert required is not None
    schema = required.schema()
    assert schema is not None
    jsonschema.validate([{"name": "weather", "parameters": {"city": "Oslo"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "weather", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: one call
        jsonschema.validate([{"name": "time", "parameters": {}}] * 2, schema)
    content, calls = required.calls('[{"name": "time", "parameters": {}}]', None)
    assert content is None and calls[0].name == "time"
    named = read_tools([WEATHER], {"type": "function", "function": {"name": "weather"}}, None)
    assert named is not None and named.schema() == CITY
    assert named.calls('{"city": "Oslo"}', None)[1][0].arguments == '{"city": "Oslo"}'
    assert named.calls('{"city": "Os', None) == ('{"city": "Os', [])  # cut short: text


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        (None, "required", "tool_choice: needs tools"),
        ([{"type": "function"}], None, r"tools\[0\]: must be"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice: names no"),
        ([WEATHER], "sometimes", "tool_choice: auto, none, required"),
    ],
)
def test_bad_tools_are_refused_by_name(tools: Any, choice: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"^{message}"):
        read_tools(tools, choice, None)


def test_forced_calls_stream_their_arguments_as_they_come() -> None:
    named = read_tools([WEATHER], {"type": "function", "function": {"name": "weather"}}, None)
    assert named is not None
    stream = CallStream(named)
    first = stream.feed('{"ci')
    assert first[0]["function"] == {"name": "weather", "arguments": '{"ci'} and first[0]["id"]
    assert stream.feed('ty": "Rome"}') == [{"index": 0, "function": {"arguments": 'ty": "Rome"}'}}]
    required = read_tools([WEATHER, TIME], "required", None)
    assert required is not None
    stream = CallStream(required)
    text = (
        '[{"name": "weather", "parameters": {"city": "R\\"o}m"}}, '
        '{"name": "time", "parameters": {}}]'
    )
    # Required: each call's id and name as its parameters open, then their text as it
    # comes (a brace inside a string does not close them), fed a character at a time.
    out = [(at, c) for at in range(len(text)) for c in stream.feed(text[at])]
    heads = [(at, c["index"], c["function"]["name"]) for at, c in out if "id" in c]
    assert heads == [(text.index("{", 2), 0, "weather"), (text.index("{}"), 1, "time")]
    for index, name in ((0, "weather"), (1, "time")):
        arguments = "".join(c["function"]["arguments"] for _, c in out if c["index"] == index)
        assert json.loads(arguments) == ({"city": 'R"o}m'} if name == "weather" else {})
    assert len([c for _, c in out if c["index"] == 0]) > 3  # not whole: piece by piece
    # Fed whole at once, the same calls; an element whose parameters come before its name
    # goes out whole when it closes.
    whole = CallStream(required).feed(text)
    assert [c["function"]["name"] for c in whole if "id" in c] == ["weather", "time"]
    late = CallStream(required).feed('[{"parameters": {"city": "Oslo"}, "name": "weather"}]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in late] == [
        ("weather", {"city": "Oslo"})
    ]


@pytest.mark.parametrize(
    "reply",
    [
        'Sure. <tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>',
        '<tool_call>{"name": "time", "arguments": {}}</tool_call> and '
        '<tool_call>{"name": "weather", "arguments": {"city": "</tool"}}</tool_call>',
        '<tool_call>{"name": "other", "arguments": {}}</tool_call>text',  # not a given tool
        "No call, a <tool mention and <tool_call> never closed",
    ],
)
def test_hermes_calls_stream_as_each_block_closes_as_the_whole_reply_reads_them(
    reply: str,
) -> None:
    tools = read_tools([WEATHER, TIME], "auto", None)
    assert tools is not None
    whole_content, whole_calls = tools.calls(reply, "hermes")
    stream = HermesStream(tools)
    pieces = [stream.feed(ch, final=at == len(reply) - 1) for at, ch in enumerate(reply)]
    content = "".join(c for c, _ in pieces)
    calls = [c for _, cs in pieces for c in cs]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c.name, c.arguments) for c in whole_calls
    ]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert (content.strip() or None) == (whole_content.strip() if whole_content else None)
