"""Grammars: a request's grammar as a mask on its row, kept across resumed tokens, and
left off a reasoning model's thoughts."""

from __future__ import annotations

import json

import pytest
import torch

from cluster.engine.grammar import Grammars
from cluster.engine.model.model_files import bundled_model_path
from cluster.engine.model.tokenizer import Tokenizer
from cluster.types import InvalidRequestError, Structured

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(bundled_model_path())


@pytest.fixture(scope="module")
def grammars(tok: Tokenizer) -> Grammars:
    return Grammars(tok, VOCAB, [EOS])


def allowed(logits_row: torch.Tensor) -> set[int]:
    return set((logits_row > float("-inf")).nonzero().flatten().tolist())


def test_only_the_rows_with_a_matcher_are_masked_to_their_grammar(
    tok: Tokenizer, grammars: Grammars
) -> None:
    choice = grammars.matcher(Structured("choice", json.dumps(["yes", "no"])), [])
    logits = torch.randn(3, VOCAB)
    masked = grammars.mask(logits, [1], [choice])
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    firsts = {tok.decode([t]) for t in allowed(masked[1])}
    assert firsts and all("yes".startswith(f) or "no".startswith(f) for f in firsts)


def test_greedy_under_a_regex_spells_a_match_then_only_eos(
    tok: Tokenizer, grammars: Grammars
) -> None:
    matcher = grammars.matcher(Structured("regex", "[0-9]{3}"), [])
    out: list[int] = []
    for _ in range(10):
        row = grammars.mask(torch.randn(1, VOCAB), [0], [matcher])[0]
        token = int(row.argmax())
        assert matcher.accept(token)
        if token == EOS:
            break
        out.append(token)
    assert len(tok.decode(out)) == 3 and tok.decode(out).isdigit()
    assert matcher.is_terminated()


def test_a_resumed_request_continues_where_its_delivered_tokens_left_it(
    tok: Tokenizer, grammars: Grammars
) -> None:
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                         "required": ["a"], "additionalProperties": False})  # fmt: skip
    delivered = tok.encode('{"a": 1', special_tokens=False)
    resumed = grammars.matcher(Structured("json_schema", schema), delivered)
    row = grammars.mask(torch.zeros(1, VOCAB), [0], [resumed])[0]
    nexts = {tok.decode([t]) for t in allowed(row)}
    assert "}" in nexts and "," not in nexts and '"' not in nexts


def test_what_does_not_compile_or_fit_is_refused_by_name(
    tok: Tokenizer, grammars: Grammars
) -> None:
    with pytest.raises(InvalidRequestError, match=r"^structured: regex does not compile"):
        grammars.matcher(Structured("regex", "(("), [])
    with pytest.raises(InvalidRequestError, match=r"^structured: delivered token"):
        grammars.matcher(Structured("regex", "[0-9]+"), tok.encode("abc", special_tokens=False))


def test_a_reasoning_reply_s_grammar_holds_only_what_follows_its_thoughts(
    tok: Tokenizer, grammars: Grammars
) -> None:
    # Two ordinary tokens stand in for <think> and </think> (the grammar never allows them).
    start, end = (tok.encode(w, special_tokens=False)[0] for w in ("Hello", "World"))
    yes_no = json.dumps(["yes", "no"])
    # Qwen3's way: the first token may open the thoughts instead; then nothing is masked
    # until </think>, and the grammar starts after it.
    qwen = grammars.matcher(Structured("choice", yes_no, end, start), [])
    first = allowed(grammars.mask(torch.zeros(1, VOCAB), [0], [qwen])[0])
    assert start in first and end not in first and len(first) < 10
    assert qwen.accept(start) and not qwen.masks
    assert qwen.accept(start) and qwen.accept(EOS) and not qwen.masks  # thoughts are free
    assert qwen.accept(end) and qwen.masks and not qwen.is_terminated()
    after = {tok.decode([t]) for t in allowed(grammars.mask(torch.zeros(1, VOCAB), [0], [qwen])[0])}
    assert after and all("yes".startswith(a) or "no".startswith(a) for a in after)
    # A Qwen3 reply that does not open with <think> is held from its first token.
    plain = grammars.matcher(Structured("choice", yes_no, end, start), [])
    assert not plain.accept(tok.encode("maybe", special_tokens=False)[0])
    # DeepSeek-R1's way: the reply starts in its thoughts; a resumed one replays them.
    r1 = grammars.matcher(Structured("choice", yes_no, end), [])
    assert not r1.masks and r1.accept(start) and not r1.masks
    yes = tok.encode("yes", special_tokens=False)
    resumed = grammars.matcher(Structured("choice", yes_no, end), [start, end, *yes])
    assert resumed.accept(EOS) and resumed.is_terminated()
