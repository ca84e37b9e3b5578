"""The OpenAI-compatible HTTP API, driven by the official `openai` client over real Ray
workers: the same tokens as the gRPC API, streaming and not, errors in OpenAI's shape
with the right status, and a client that disconnects frees its pages."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
import ray

from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams
from tests.helpers import wait_until
from tests.integration.router_harness import RouterHarness, ask

MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def router(ray_workers: Any) -> Iterator[RouterHarness]:
    prefill = {"prefill": ray_workers.prefill("prefill")}
    decode = {"decode": ray_workers.decode("decode", local_prefill_tokens=0)}
    harness = RouterHarness(prefill, decode, redis_url=None, http_port=0)
    yield harness
    harness.stop()


@pytest.fixture(scope="module")
def client(router: RouterHarness) -> openai.OpenAI:
    assert router.app.http is not None
    return openai.OpenAI(base_url=router.app.http.address + "/v1", api_key="unused", timeout=120)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_equals_the_grpc_api_streamed_and_not(
    router: RouterHarness, client: openai.OpenAI, workers: Any
) -> None:
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    grpc = ask(router.address, messages, max_tokens=24, seed=5, temperature=0.7)
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, seed=5, temperature=0.7
    )
    assert whole.choices[0].message.content == grpc.text
    assert whole.choices[0].finish_reason == grpc.finish_reason
    assert whole.usage is not None and whole.usage.completion_tokens == len(grpc.token_ids)
    assert whole.usage.prompt_tokens == grpc.usage.prompt_tokens
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, seed=5, temperature=0.7,
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == grpc.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == grpc.finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(grpc.token_ids)


def test_completions_from_token_ids_with_a_stop_string(
    client: openai.OpenAI, twin: LLMEngine, workers: Any
) -> None:
    ids = twin.tokenizer.encode("Count with me: one, two, three,")
    offline = twin.generate([ids], SamplingParams(max_tokens=20, stop=(" six",)))[0]
    reply = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=20, stop=" six", temperature=0
    )
    assert reply.choices[0].text == offline.text
    assert reply.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=20, stop=[" six"], stream=True, temperature=0
    )
    assert "".join(c.choices[0].text for c in streamed) == offline.text


def test_logprobs_of_the_chosen_tokens(client: openai.OpenAI, workers: Any) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        logprobs=True,
        temperature=0,
    )
    assert reply.choices[0].logprobs is not None
    content = reply.choices[0].logprobs.content
    assert content is not None and len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    assert all(t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == reply.choices[0].message.content


def test_penalties_bias_min_tokens_and_stop_ids_are_honoured_as_the_engine_does(
    client: openai.OpenAI, twin: LLMEngine, workers: Any
) -> None:
    """Disaggregated here (the prefill worker samples the first token) and colocated in
    `twin`: the same tokens, and not those of a plain greedy run."""
    ids = twin.tokenizer.encode("Count with me: one, two, three,")

    def served(**extra: Any) -> openai.types.Completion:
        return client.completions.create(
            model=MODEL, prompt=ids, max_tokens=16, temperature=0, **extra
        )

    plain = twin.generate([ids], SamplingParams(max_tokens=16))[0]
    first = plain.token_ids[0]
    cases: list[tuple[dict[str, Any], SamplingParams]] = [
        ({"presence_penalty": 2.0, "frequency_penalty": 2.0,
          "extra_body": {"repetition_penalty": 1.8}},
         SamplingParams(max_tokens=16, presence_penalty=2.0, frequency_penalty=2.0,
                        repetition_penalty=1.8)),
        ({"logit_bias": {str(first): -100}},
         SamplingParams(max_tokens=16, logit_bias=((first, -100.0),))),
        ({"extra_body": {"stop_token_ids": [plain.token_ids[2]]}},
         SamplingParams(max_tokens=16, stop_token_ids=(plain.token_ids[2],))),
    ]  # fmt: skip
    for extra, params in cases:
        offline = twin.generate([ids], params)[0]
        reply = served(**extra)
        assert reply.choices[0].text == offline.text != plain.text, extra
        assert reply.usage is not None
        assert reply.usage.completion_tokens == len(offline.token_ids)
    stopped = served(extra_body={"stop_token_ids": [plain.token_ids[2]]})
    assert (stopped.choices[0].finish_reason, stopped.usage.completion_tokens) == ("stop", 3)  # type: ignore[union-attr]


def test_min_tokens_bars_eos_until_reached_and_a_stop_string_can_be_kept(
    client: openai.OpenAI, twin: LLMEngine, workers: Any
) -> None:
    messages = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    short = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0
    )
    assert short.choices[0].finish_reason == "stop" and short.usage is not None
    n = short.usage.completion_tokens
    longer = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=40,
        temperature=0,
        extra_body={"min_tokens": n + 5},
    )
    assert longer.usage is not None and longer.usage.completion_tokens >= n + 5
    ids = twin.tokenizer.encode("Count with me: one, two, three,")
    kept = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=20, stop=" five", temperature=0,
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    cut = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=20, stop=" five", temperature=0
    )
    assert kept.choices[0].text == cut.choices[0].text + " five"


@pytest.mark.parametrize(
    "fields, status, param",
    [
        ({"temperature": "hot"}, 400, "temperature"),
        ({"n": 17}, 400, "n"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"messages": []}, 400, "messages"),
        ({"top_logprobs": 3}, 400, "top_logprobs"),
        ({"response_format": {"type": "yaml"}}, 400, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, 400, "tools[0].function"),
        ({"extra_body": {"guided_decoding_backend": "outlines"}}, 400, "guided_decoding_backend"),
        ({"extra_body": {"temprature": 0.5}}, 400, "temprature"),
        ({"presence_penalty": 3}, 400, "presence_penalty"),
        ({"logit_bias": {"99999999": 1}}, 400, "logit_bias"),
        ({"extra_body": {"min_tokens": 9}, "max_tokens": 4}, 400, "min_tokens"),
        ({"model": "gpt-4o"}, 404, "model"),
        ({"model": "x" * 10_000}, 404, "model"),
        ({"messages": [{"role": "r" * 10_000, "content": "Hi"}]}, 400, "messages[0].role"),
    ],
)
def test_a_bad_request_gets_openai_error_json_naming_the_field(
    client: openai.OpenAI, fields: dict[str, Any], status: int, param: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    body.update(fields)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(**body)
    assert err.value.status_code == status
    error = err.value.body
    assert isinstance(error, dict) and error["param"] == param
    assert str(error["message"]).startswith(param) and len(str(error["message"])) < 300


def test_a_full_router_refuses_a_long_prompt_before_tokenizing_it(
    router: RouterHarness, client: openai.OpenAI
) -> None:
    # Tokenized first, this prompt would be refused as too long (400), not as overload.
    router.app.router.max_pending = 0
    try:
        with pytest.raises(openai.RateLimitError):
            client.with_options(max_retries=0).completions.create(
                model=MODEL, prompt="x" * 200_000, max_tokens=4
            )
    finally:
        router.app.router.max_pending = 256
    assert router.app.router.pending == 0


def test_malformed_json_is_a_400_and_health_and_metrics_answer(router: RouterHarness) -> None:
    assert router.app.http is not None
    base = router.app.http.address
    bad = urllib.request.Request(base + "/v1/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(bad, timeout=30)
    assert err.value.code == 400
    assert json.loads(err.value.read())["error"]["message"].startswith("body: not valid JSON")
    with urllib.request.urlopen(base + "/health", timeout=30) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        assert b"splitserve_requests_total" in r.read()


def http(base: str, path: str, body: Any = None, method: str | None = None) -> tuple[int, Any]:
    """Status and JSON body of one request, errors included."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_omitted_max_tokens_fills_a_chat_stops_a_completion_at_16_and_temperature_is_1(
    router: RouterHarness, client: openai.OpenAI, twin: LLMEngine, workers: Any
) -> None:
    """OpenAI's and vLLM's defaults (this model ships no generation config): a chat's reply
    may fill what the context leaves; a completion's stops at 16 tokens; sampling draws
    (seeded: the same twice, not greedy)."""
    messages = [{"role": "user", "content": "Tell me a story"}]
    ids = twin.tokenizer.encode_chat(messages)
    assert router.app.http is not None
    room = router.app.http.model.max_model_len - len(ids)
    # The refusal names the max_tokens an omitted one became: all the context leaves.
    with pytest.raises(openai.BadRequestError, match=rf"must be <= max_tokens \({room}\)"):
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            extra_body={"min_tokens": room + 1},  # type: ignore[arg-type]
        )
    with pytest.raises(openai.BadRequestError, match=r"must be <= max_tokens \(16\)"):
        client.completions.create(model=MODEL, prompt="Hi", extra_body={"min_tokens": 17})
    prompt = twin.tokenizer.encode("Once upon a time")
    short = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True}
    )
    assert short.choices[0].finish_reason == "length" and short.usage is not None
    assert short.usage.completion_tokens == 16
    greedy = twin.generate([prompt], SamplingParams(max_tokens=24))[0].text
    drawn = [
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, seed=s).choices[0].text
        for s in (1, 1, 2)
    ]
    assert drawn[0] == drawn[1] and greedy not in drawn


def test_a_seed_spans_64_bits_and_top_k_minus_one_is_off(
    router: RouterHarness, client: openai.OpenAI, workers: Any
) -> None:
    """torch's seeds are 64 bits unsigned: 2^64 - 1 is the seed -1 (vLLM's int64 spelling);
    past 64 bits is a 400 naming `seed`, not a 500. vLLM's top_k -1 is no top-k at all."""

    def text(**extra: Any) -> str:
        reply = client.completions.create(
            model=MODEL, prompt="The sky is", max_tokens=12, temperature=1.0, **extra
        )
        return reply.choices[0].text

    assert text(seed=2**64 - 1) == text(seed=-1) != text(seed=2**63 - 1)
    assert text(seed=2**63) == text(seed=-(2**63))
    assert (
        text(seed=4, extra_body={"top_k": -1})
        == text(seed=4)
        != text(seed=4, extra_body={"top_k": 2})
    )
    assert router.app.http is not None
    status, err = http(router.app.http.address, "/v1/completions",
                       {"prompt": "Hi", "seed": 2**64})  # fmt: skip
    assert (status, err["error"]["param"]) == (400, "seed")


def test_tokenize_detokenize_version_and_one_model(
    router: RouterHarness, client: openai.OpenAI, twin: LLMEngine
) -> None:
    assert router.app.http is not None
    base = router.app.http.address
    text = "The capital of France is"
    status, got = http(base, "/tokenize", {"model": MODEL, "prompt": text})
    ids = twin.tokenizer.encode(text)
    assert (status, got["tokens"], got["count"]) == (200, ids, len(ids))
    messages = [{"role": "user", "content": "Hi"}]
    status, chat = http(base, "/tokenize", {"messages": messages})
    assert (status, chat["tokens"]) == (200, twin.tokenizer.encode_chat(messages))
    assert http(base, "/detokenize", {"tokens": ids}) == (200, {"prompt": text})
    status, version = http(base, "/version")
    assert status == 200 and version["version"]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    status, err = http(base, "/detokenize", {"tokens": [10**9]})
    assert (status, err["error"]["param"]) == (400, "tokens")


def test_tokenize_takes_vllms_fields(router: RouterHarness, twin: LLMEngine) -> None:
    """`add_generation_prompt` false leaves the assistant's turn unopened; `add_special_tokens`
    is taken; `return_token_strs` gives each id's token; a template variable the template
    does not read, or `reasoning_effort` on a template without it, is refused by name."""
    assert router.app.http is not None
    base = router.app.http.address
    messages = [{"role": "user", "content": "Hi"}]
    hf = twin.tokenizer.hf
    status, got = http(base, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert status == 200
    assert (
        got["tokens"] == hf.apply_chat_template(messages, add_generation_prompt=False)["input_ids"]
    )
    assert len(got["tokens"]) < len(twin.tokenizer.encode_chat(messages))
    body = {"prompt": "Hi there", "add_special_tokens": False, "return_token_strs": True}
    status, got = http(base, "/tokenize", body)
    assert (status, got["tokens"]) == (200, twin.tokenizer.encode("Hi there", special_tokens=False))
    assert got["token_strs"] == hf.convert_ids_to_tokens(got["tokens"])
    status, got = http(base, "/tokenize", {"prompt": "Hi"})
    assert (status, got["token_strs"]) == (200, None)
    unread = {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
    status, err = http(base, "/tokenize", unread)
    assert (status, err["error"]["param"]) == (400, "chat_template_kwargs.enable_thinking")
    assert "it reads add_generation_prompt, messages" in err["error"]["message"]
    status, err = http(base, "/v1/chat/completions",
                       {"messages": messages, "reasoning_effort": "low"})  # fmt: skip
    assert (status, err["error"]["param"]) == (400, "reasoning_effort")


def test_unknown_paths_and_methods_answer_openai_error_json(router: RouterHarness) -> None:
    assert router.app.http is not None
    base = router.app.http.address
    status, err = http(base, "/v1/nothing-here")
    assert status == 404 and err["error"]["message"].startswith("GET /v1/nothing-here")
    status, err = http(base, "/v1/chat/completions")
    assert status == 405 and err["error"]["type"] == "invalid_request_error"


def test_a_client_that_disconnects_mid_stream_frees_its_pages(
    router: RouterHarness, client: openai.OpenAI, workers: Any
) -> None:
    def cancelled() -> float:
        value = router.app.metrics.registry.get_sample_value(
            "splitserve_requests_total", {"status": "cancelled"}
        )
        return value or 0.0

    before = cancelled()
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a very long story."}],
        max_tokens=2000, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the connection goes; the request must be aborted on every worker
    decode = workers.handles["decode"]
    wait_until(
        lambda: cancelled() > before and not ray.get(decode.stats.remote()).running,
        "the request to stop after the client left",
    )
    assert cancelled() == before + 1
    # the `workers` fixture then asserts every page on every worker is free


SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer"}},
                  "required": ["id"], "additionalProperties": False}},
     "required": ["colour", "tags", "owner"], "additionalProperties": False},
]  # fmt: skip


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "nested"])
def test_a_json_schema_reply_parses_and_validates(
    client: openai.OpenAI, schema: dict[str, Any], workers: Any
) -> None:
    """Disaggregated: the prefill worker samples the first token under the grammar too."""
    reply = client.chat.completions.create(
        model=MODEL, max_tokens=120, temperature=0,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), schema)


def test_json_object_choice_and_regex_hold(client: openai.OpenAI, workers: Any) -> None:
    def ask(**extra: Any) -> str:
        messages = [{"role": "user", "content": "Is the sky blue? Answer."}]
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=60, temperature=0.8, seed=3, **extra
        )
        return reply.choices[0].message.content or ""

    assert isinstance(json.loads(ask(response_format={"type": "json_object"})), dict)
    assert ask(extra_body={"guided_choice": ["yes", "no"]}) in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", ask(extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"}))
    with pytest.raises(openai.BadRequestError) as err:
        ask(extra_body={"guided_regex": "(("})
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "response_format"


def test_n_choices_are_the_requests_with_seeds_seed_plus_i(
    client: openai.OpenAI, workers: Any
) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    args: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 12,
                            "temperature": 1.0}  # fmt: skip
    whole = client.chat.completions.create(n=3, seed=40, **args)
    alone = [client.chat.completions.create(seed=40 + i, **args) for i in range(3)]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.message.content for c in whole.choices] == [
        a.choices[0].message.content for a in alone
    ]
    assert whole.usage is not None and alone[0].usage is not None
    assert whole.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)  # type: ignore[union-attr]
    texts = ["", "", ""]
    for chunk in client.chat.completions.create(n=3, seed=40, stream=True, **args):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in whole.choices]


def test_a_list_of_prompts_answers_each_as_alone(client: openai.OpenAI, workers: Any) -> None:
    prompts = ["The capital of France is", "Water boils at", "One, two,"]
    args: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    whole = client.completions.create(prompt=prompts, n=2, **args)
    alone = [client.completions.create(prompt=p, **args) for p in prompts]
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.text for c in whole.choices] == [a.choices[0].text for a in alone for _ in "ab"]
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # type: ignore[union-attr]
    assert whole.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)  # type: ignore[union-attr]


def test_top_logprobs_come_with_every_token_the_first_one_too(
    client: openai.OpenAI, workers: Any
) -> None:
    """Disaggregated: the first token's alternatives come from the prefill worker."""
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=5,
    )  # fmt: skip
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen is the top one
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-4
    completion = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, logprobs=3
    )
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and lp.tokens is not None
    assert [len(t) for t in lp.top_logprobs] == [3] * len(lp.tokens)
    tops = zip(lp.top_logprobs, lp.tokens, strict=True)
    assert all(max(t, key=t.__getitem__) == tok for t, tok in tops)


def test_echo_leads_with_the_prompt_and_best_of_returns_the_likeliest(
    client: openai.OpenAI, workers: Any
) -> None:
    args: dict[str, Any] = {"model": MODEL, "prompt": "The sky is", "max_tokens": 5}
    plain = client.completions.create(temperature=0, **args).choices[0].text
    echoed = client.completions.create(temperature=0, echo=True, **args).choices[0].text
    assert echoed == "The sky is" + plain
    streamed = client.completions.create(temperature=0, echo=True, stream=True, **args)
    assert "".join(c.choices[0].text for c in streamed) == echoed
    candidates = client.completions.create(temperature=1.0, seed=7, n=4, logprobs=0, **args)
    best = client.completions.create(temperature=1.0, seed=7, n=2, best_of=4, **args)
    ranked = sorted(candidates.choices, key=lambda c: -sum(c.logprobs.token_logprobs))  # type: ignore[arg-type, union-attr]
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert best.choices[0].logprobs is None  # not asked for: used, not returned


def test_echo_with_logprobs_gives_the_prompts_tokens_theirs(
    client: openai.OpenAI, twin: LLMEngine, workers: Any
) -> None:
    """The prompt's logprobs are computed where the prompt is (the decode worker here,
    whatever the routing), never from the prefix cache: asked twice, the same."""
    prompt = "The sky is blue and the grass is"
    ids = twin.tokenizer.encode(prompt)
    args: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 3,
                            "temperature": 0, "echo": True, "logprobs": 2}  # fmt: skip
    reply = client.completions.create(**args)
    again = client.completions.create(**args)
    lp = reply.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None
    assert lp.tokens[: len(ids)] == [twin.tokenizer.decode([t]) for t in ids]
    assert len(lp.tokens) == len(ids) + 3 and reply.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert value is not None and top and value <= max(top.values()) + 1e-5
    assert again.choices[0].logprobs == lp
    streamed = client.completions.create(stream=True, **args)
    first = next(iter(streamed)).choices[0].logprobs
    assert first is not None and first.tokens is not None
    assert first.tokens[: len(ids)] == lp.tokens[: len(ids)]


def test_the_seed_flag_draws_unseeded_requests_alike_on_every_start(
    ray_workers: Any, workers: Any
) -> None:
    """router.seed (`--seed`): sampled requests that bring no seed get theirs from it, so
    the same requests in the same order answer alike after a restart (and differ from one
    another)."""
    texts = []
    for _ in range(2):
        harness = RouterHarness(
            {"prefill": ray_workers.prefill("prefill")},
            {"decode": ray_workers.decode("decode", local_prefill_tokens=0)},
            redis_url=None, http_port=0, seed=7,
        )  # fmt: skip
        try:
            assert harness.app.http is not None
            fresh = openai.OpenAI(base_url=harness.app.http.address + "/v1", api_key="x")
            texts.append([
                fresh.completions.create(model=MODEL, prompt="The sky is", max_tokens=8,
                                         temperature=1.0).choices[0].text
                for _ in range(2)
            ])  # fmt: skip
        finally:
            harness.stop()
    assert texts[0] == texts[1] and texts[0][0] != texts[0][1]
