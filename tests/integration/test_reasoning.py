"""A reasoning parser on the OpenAI chat API through the official `openai` client (router
.reasoning_parser, vLLM's --reasoning-parser): the bundled model served with a template
that opens `<think>` in the prompt, as DeepSeek-R1's does, so its reply is its thoughts
(`reasoning_content`), the same streamed and not; structured output with a parser is
refused naming the field. The split itself, tags across deltas: tests/unit/test_reasoning.py."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams
from tests.integration.router_harness import RouterHarness

MODEL = "SmolLM2-135M-Instruct.Q4_1"
TEMPLATE = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""
MESSAGES: list[Any] = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def router(ray_workers: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterHarness]:
    template = tmp_path_factory.mktemp("template") / "r1.jinja"
    template.write_text(TEMPLATE)
    decode = {"colocated": ray_workers.decode("colocated")}
    harness = RouterHarness({}, decode, redis_url=None, http_port=0, chat_template=str(template),
                            reasoning_parser="deepseek_r1")  # fmt: skip
    yield harness
    harness.stop()


@pytest.fixture(scope="module")
def client(router: RouterHarness) -> openai.OpenAI:
    assert router.app.http is not None
    return openai.OpenAI(base_url=router.app.http.address + "/v1", api_key="x", timeout=120)


def test_thoughts_are_reasoning_content_streamed_and_not(
    router: RouterHarness, client: openai.OpenAI, twin: LLMEngine, workers: Any
) -> None:
    assert router.app.http is not None
    ask = urllib.request.Request(
        router.app.http.address + "/tokenize", data=json.dumps({"messages": MESSAGES}).encode()
    )
    with urllib.request.urlopen(ask, timeout=60) as r:
        ids = json.loads(r.read())["tokens"]
    thoughts = twin.generate([ids], SamplingParams(max_tokens=10))[0].text
    assert "</think>" not in thoughts  # cut short inside its thoughts: all reasoning
    args: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10,
                            "temperature": 0}  # fmt: skip
    whole = client.chat.completions.create(**args).choices[0].message
    assert (whole.reasoning_content, whole.content) == (thoughts, None)  # type: ignore[attr-defined]
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**args, stream=True)
              if c.choices]  # fmt: skip
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thoughts
    assert not any(d.content for d in deltas)


def test_structured_output_with_a_reasoning_parser_is_refused_naming_the_field(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError, match="response_format: structured output is "
                       "not served with the reasoning parser"):  # fmt: skip
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}
        )
