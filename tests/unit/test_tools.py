"""router/tools.py: tools and tool_choice checked, the forcing schema, the reply parsers."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from cluster.types import InvalidRequestError
from router.tools import hermes, llama3_json, parser_for, read_tools

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
    assert parser_for("{% for m in messages %}{{ m.content }}{% endfor %}") is None


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
