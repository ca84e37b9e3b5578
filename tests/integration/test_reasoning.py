"""A reasoning parser on the OpenAI chat API through the official `openai` client (router
.reasoning_parser, vLLM's --reasoning-parser): the bundled model served with a template
that opens `<think>` in the prompt, as DeepSeek-R1's does, so its reply is its thoughts
(`reasoning_content`), the same streamed and not; structured output with a parser is
refused naming the field where the tokenizer has no `</think>` token, and on a tiny model
whose tokenizer has one the grammar holds only what follows the thoughts (in the engine,
and served through the router, streamed and not). The split
itself, tags across deltas: tests/unit/test_reasoning.py."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.types import FinishReason, SamplingParams, Structured
from tests.helpers import assert_no_leak
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


def test_structured_output_needs_a_think_token_of_its_own_and_is_refused_naming_the_field(
    client: openai.OpenAI,
) -> None:
    # The bundled tokenizer spells </think> in several tokens: the engine, which holds the
    # grammar from the token after it, could not tell where the thoughts end.
    refused = r"response_format: structured output with the reasoning parser \(deepseek_r1\)"
    with pytest.raises(openai.BadRequestError, match=refused + " starts after </think>"):
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}
        )


YES_NO = json.dumps(["yes", "no"])


def test_the_grammar_holds_only_the_reply_after_its_thoughts(tiny_thinker_dir: Path) -> None:
    """A tiny Qwen3 whose tokenizer has <think> and </think>: logit biases make it open and
    close its thoughts at once, and the grammar (one of two words) holds what follows:
    DeepSeek-R1's way (thinking from the first token), Qwen3's (only when the reply opens
    with <think>), a plain grammar (</think> never allowed), and a request resumed after
    its thoughts (a migrated one) giving the uninterrupted request's tokens."""
    engine = LLMEngine(EngineConfig(model=str(tiny_thinker_dir), dtype="float32",
                                    quantization="none", kv_cache_gb=0.01))  # fmt: skip
    start, end = (engine.tokenizer.encode(t, special_tokens=False) for t in ("<think>", "</think>"))
    assert start == [49152] and end == [49153]
    prompt = engine.tokenizer.encode("Is it raining in Paris today?")

    def held(*bounds: int, **bias: int) -> SamplingParams:
        tags = {"start": start[0], "end": end[0]}
        logit_bias = tuple((tags[name], float(b)) for name, b in bias.items())
        return SamplingParams(max_tokens=8, logit_bias=logit_bias,
                              structured=Structured("choice", YES_NO, *bounds))  # fmt: skip

    r1, qwen, plain = engine.generate(
        [prompt] * 3,
        [held(end[0], end=100), held(end[0], start[0], start=99, end=100), held(end=100)],
    )
    assert r1.token_ids[0] == end[0] and r1.text in ("</think>yes", "</think>no")
    assert qwen.token_ids[:2] == start + end and qwen.text in ("<think></think>yes",
                                                               "<think></think>no")  # fmt: skip
    assert plain.text in ("yes", "no") and end[0] not in plain.token_ids
    assert {c.finish_reason for c in (r1, qwen, plain)} == {FinishReason.STOP}
    resumed = engine.add_request(prompt + start + end, held(end[0], start[0], start=99, end=100),
                                 resumed=2)  # fmt: skip
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.request_id == resumed for t in o.new_token_ids]
    assert tokens == qwen.token_ids[2:]
    assert_no_leak(engine)


@pytest.fixture(scope="module")
def thinker(ray_workers: Any, tiny_thinker_dir: Path) -> Iterator[openai.OpenAI]:
    """The tiny model whose tokenizer has </think>, served with the deepseek_r1 parser."""
    engine = {"model": str(tiny_thinker_dir), "dtype": "float32", "quantization": "none"}
    decode = {"thinker": ray_workers.decode("thinker", engine=engine)}
    harness = RouterHarness({}, decode, redis_url=None, http_port=0, model=str(tiny_thinker_dir),
                            reasoning_parser="deepseek_r1")  # fmt: skip
    assert harness.app.http is not None
    yield openai.OpenAI(base_url=harness.app.http.address + "/v1", api_key="x", timeout=120)
    harness.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_served_reply_s_grammar_starts_after_its_thoughts(
    thinker: openai.OpenAI, stream: bool
) -> None:
    # </think> biased first: the reply's thoughts end at once (empty), and guided_choice
    # holds what follows. Were the grammar to hold the thoughts too, </think> could never
    # come and the whole reply would read as reasoning.
    args: dict[str, Any] = {
        "model": "tiny-thinker",
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 0,
        "logit_bias": {"49153": 100},
        "extra_body": {"guided_choice": ["yes", "no"]},
    }
    if not stream:
        message = thinker.chat.completions.create(**args).choices[0].message
        assert message.content in ("yes", "no")
        assert not getattr(message, "reasoning_content", None)
        return
    deltas = [c.choices[0].delta for c in thinker.chat.completions.create(**args, stream=True)
              if c.choices]  # fmt: skip
    assert "".join(d.content or "" for d in deltas) in ("yes", "no")
    assert not any(getattr(d, "reasoning_content", None) for d in deltas)
