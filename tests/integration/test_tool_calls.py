"""Tool calls through the official `openai` package on a colocated worker (it prefills
itself), the router serving a Hermes-style chat template (router.chat_template) that
renders tools: a named call that always parses, streamed and not, then the tool's result
in the history and a final answer: a whole agent loop."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from cluster.engine.engine import LLMEngine
from router.tools import with_tool_prompt
from tests.integration.router_harness import RouterHarness

MODEL = "SmolLM2-135M-Instruct.Q4_1"
TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions. Tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": <name>, "arguments": <arguments>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
{%- set f = call.function %}
<tool_call>{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"], "additionalProperties": False}  # fmt: skip
WEATHER = {"name": "get_weather", "description": "The weather in a city", "parameters": CITY}
TOOLS: list[Any] = [{"type": "function", "function": WEATHER}]


@pytest.fixture(scope="module")
def client(ray_workers: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    template = tmp_path_factory.mktemp("template") / "hermes.jinja"
    template.write_text(TEMPLATE)
    decode = {"colocated": ray_workers.decode("colocated")}
    harness = RouterHarness({}, decode, redis_url=None, http_port=0, chat_template=str(template))
    assert harness.app.http is not None
    yield openai.OpenAI(base_url=harness.app.http.address + "/v1", api_key="x", timeout=120)
    harness.stop()


def _weather_call(reply: Any) -> Any:
    """The reply's first tool call, which must be get_weather's, the reply ending in calls."""
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    return call


def test_an_agent_loop_calls_a_tool_reads_its_result_and_answers(
    client: openai.OpenAI, workers: Any
) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=named, max_tokens=40,
        temperature=0,
    )  # fmt: skip
    call = _weather_call(first)
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"})
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=30,
        temperature=0,
    )  # fmt: skip
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_a_named_calls_arguments_stream_as_deltas(client: openai.OpenAI, workers: Any) -> None:
    """As vLLM streams them: the call's id and name first, then its arguments' text piece
    by piece, adding up to the reply's arguments unstreamed."""
    args: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "Weather in Rome?"}],
        "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 40, "temperature": 0,
    }  # fmt: skip
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls
    assert whole is not None
    chunks = list(client.chat.completions.create(**args, stream=True))
    deltas = [c for ch in chunks for choice in ch.choices for c in choice.delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and not d.id for d in deltas[1:]) and len(deltas) > 2
    streamed = "".join((d.function.arguments or "") for d in deltas if d.function)
    assert streamed == whole[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_streams_each_calls_arguments_and_auto_parses_or_answers(
    client: openai.OpenAI, workers: Any
) -> None:
    messages = [{"role": "user", "content": "Weather in Rome and in Oslo?"}]
    args: dict[str, Any] = {"model": MODEL, "messages": messages, "tools": TOOLS,
                            "tool_choice": "required", "max_tokens": 80,
                            "temperature": 0}  # fmt: skip
    chunks = list(client.chat.completions.create(**args, stream=True))
    deltas = [c for ch in chunks for choice in ch.choices for c in choice.delta.tool_calls or []]
    names = {c.index: c.function.name for c in deltas if c.id and c.function}
    arguments = {i: "".join(c.function.arguments or "" for c in deltas
                            if c.index == i and c.function) for i in names}  # fmt: skip
    assert names and set(names.values()) == {"get_weather"}
    assert len(deltas) > len(names)  # the arguments came in pieces after each name
    assert all("city" in json.loads(a) for a in arguments.values())
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls or []
    assert [json.loads(arguments[i]) for i in sorted(names)] == [
        json.loads(c.function.arguments)
        for c in whole  # type: ignore[union-attr]
    ]
    auto = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=40, temperature=0
    )
    message = auto.choices[0].message
    assert message.content or message.tool_calls  # the model's choice, parsed either way
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=40, temperature=0, stream=True
    )  # Hermes blocks go out as calls as each closes, the rest as content
    deltas = [choice.delta for chunk in streamed for choice in chunk.choices]
    calls = [(c.function.name, c.function.arguments) for d in deltas
             for c in d.tool_calls or [] if c.function]  # fmt: skip
    assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    content = "".join(d.content or "" for d in deltas).strip()
    assert content == (message.content or "").strip()


def test_a_template_that_ignores_tools_gets_the_default_tool_prompt_and_required_calls(
    ray_workers: Any, twin: LLMEngine, workers: Any
) -> None:
    """The bundled model's own template renders no tools: they go in the default tool
    prompt, a system message, and `tool_choice: required` answers a call that parses."""
    harness = RouterHarness({}, {"colocated": ray_workers.decode("colocated")}, None, http_port=0)
    try:
        assert harness.app.http is not None
        plain = openai.OpenAI(base_url=harness.app.http.address + "/v1", api_key="x", timeout=120)
        messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
        reply = plain.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=60,
            temperature=0,
        )  # fmt: skip
        call = _weather_call(reply)
        jsonschema.validate(json.loads(call.function.arguments), CITY)
        prompt = with_tool_prompt(messages, TOOLS)
        assert reply.usage is not None
        assert reply.usage.prompt_tokens == len(twin.tokenizer.encode_chat(prompt))
    finally:
        harness.stop()
