"""Workload specs: the bundled ones load and generate in range; bad ones name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.serve_workload import (
    VOCAB_SIZE,
    load_workload,
    make_conversations,
    workload_from_dict,
)
from bench.workload import FIRST_ID, LengthDist
from cluster.config import ConfigError


def test_chat_is_one_turn_with_sharegpt_like_lengths() -> None:
    spec = load_workload("chat")
    assert spec.prompt == LengthDist(110, 0.8, 16, 512)
    conversations = make_conversations(spec, 200, seed=0)
    assert all(len(c.turns) == 1 and c.session_id == "" for c in conversations)
    prompts = sorted(len(c.turns[0].user) for c in conversations)
    outputs = [c.turns[0].output_len for c in conversations]
    assert prompts[0] >= 16 and prompts[-1] <= 512
    assert 80 <= prompts[100] <= 140  # the median is about 110
    assert all(16 <= n <= 256 for n in outputs)
    ids = [t for c in conversations for t in c.turns[0].user]
    assert min(ids) >= FIRST_ID and max(ids) < VOCAB_SIZE


def test_long_prompt_lengths_are_uniform_in_range() -> None:
    conversations = make_conversations(load_workload("long-prompt"), 300, seed=1)
    prompts = [len(c.turns[0].user) for c in conversations]
    outputs = [c.turns[0].output_len for c in conversations]
    assert 1500 <= min(prompts) < 1550 and 1950 < max(prompts) <= 2000
    assert 16 <= min(outputs) < 20 and 60 < max(outputs) <= 64


def test_multi_turn_conversations_have_2_to_4_turns_and_their_own_session() -> None:
    conversations = make_conversations(load_workload("multi-turn"), 100, seed=2, run=3)
    assert {len(c.turns) for c in conversations} == {2, 3, 4}
    sessions = {c.session_id for c in conversations}
    assert len(sessions) == 100 and "" not in sessions


def test_runs_share_lengths_but_not_token_ids() -> None:
    spec = load_workload("multi-turn")
    a, b = make_conversations(spec, 20, seed=5, run=1), make_conversations(spec, 20, seed=5, run=2)
    shape = lambda cs: [[(len(t.user), t.output_len) for t in c.turns] for c in cs]
    assert shape(a) == shape(b)
    assert all(x.turns[0].user != y.turns[0].user for x, y in zip(a, b, strict=True))
    assert make_conversations(spec, 20, seed=5, run=1) == a


def test_a_spec_file_by_path(tmp_path: Path) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text(
        "prompt: {dist: uniform, low: 4, high: 4}\noutput: {dist: uniform, low: 2, high: 3}"
    )
    spec = load_workload(str(path))
    assert spec.name == "tiny" and not spec.multi_turn
    conversation = make_conversations(spec, 1, seed=0)[0]
    assert len(conversation.turns[0].user) == 4


GOOD = {"dist": "lognormal", "median": 50, "sigma": 0.5, "low": 8, "high": 64}
UNIFORM = {"dist": "uniform", "low": 2, "high": 4}


@pytest.mark.parametrize(
    "doc, field",
    [
        ([], "top level"),
        ({"output": GOOD}, "prompt"),
        ({"prompt": GOOD, "output": GOOD, "turn": GOOD}, "turn"),
        ({"prompt": GOOD, "output": 5}, "output"),
        ({"prompt": {**GOOD, "dist": "normal"}, "output": GOOD}, "prompt.dist"),
        ({"prompt": {**GOOD, "mean": 3}, "output": GOOD}, "prompt.mean"),
        ({"prompt": GOOD, "output": {**GOOD, "median": 0}}, "output.median"),
        ({"prompt": GOOD, "output": {**GOOD, "sigma": -1}}, "output.sigma"),
        ({"prompt": {**GOOD, "low": 0}, "output": GOOD}, "prompt.low"),
        ({"prompt": {**GOOD, "low": 8.5}, "output": GOOD}, "prompt.low"),
        ({"prompt": {**GOOD, "high": 4}, "output": GOOD}, "prompt.high"),
        ({"prompt": {**GOOD, "high": True}, "output": GOOD}, "prompt.high"),
        ({"prompt": GOOD, "output": {"dist": "uniform", "low": 2}}, "output.high"),
        ({"prompt": GOOD, "output": GOOD, "turns": {**UNIFORM, "low": 0}}, "turns.low"),
    ],
)
def test_a_bad_spec_names_the_field(doc: Any, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}:"):
        workload_from_dict("bad", doc)


def test_a_bad_file_names_the_file_and_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "prompt: {dist: uniform, low: 9, high: 5}\noutput: {dist: uniform, low: 1, high: 2}"
    )
    with pytest.raises(ConfigError, match=r"bad\.yaml: prompt\.high: must be an integer >= low"):
        load_workload(str(path))
    with pytest.raises(ConfigError, match="workload nope: not found"):
        load_workload("nope")
