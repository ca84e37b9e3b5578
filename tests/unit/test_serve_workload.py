"""Workload specs: the bundled ones load and generate in range; bad ones name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.config import ConfigError
from splitserve.serve_workload import (
    VOCAB_SIZE,
    Conversation,
    Turn,
    ideal_cached_tokens,
    load_workload,
    make_conversations,
    workload_from_dict,
)
from splitserve.workload import FIRST_ID, LengthDist


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


def test_shared_prefix_conversations_start_with_one_of_8_system_prompts() -> None:
    spec = load_workload("shared-prefix")
    conversations = make_conversations(spec, 200, seed=4, run=1)
    prompts = [c.turns[0].user for c in conversations]
    systems = system_prompts(prompts)
    assert len(systems) == 8 and all(len(c.turns) == 1 for c in conversations)
    assert all(1024 <= len(system) <= 2048 for system in systems.values())
    assert all(16 <= len(p) - len(systems[tuple(p[:1024])]) <= 64 for p in prompts)
    # Another run: new token ids, the same lengths.
    again = [c.turns[0].user for c in make_conversations(spec, 200, seed=4, run=2)]
    assert [len(p) for p in again] == [len(p) for p in prompts] and again != prompts


def system_prompts(prompts: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    """Each system prompt, by its first 1024 ids (all are longer): the longest prefix
    common to the prompts that start with it (their questions are random)."""
    groups: dict[tuple[int, ...], list[list[int]]] = {}
    for p in prompts:
        groups.setdefault(tuple(p[:1024]), []).append(p)
    return {key: _common_prefix(group) for key, group in groups.items()}


def _common_prefix(group: list[list[int]]) -> list[int]:
    n = 0
    while all(len(p) > n and p[n] == group[0][n] for p in group):
        n += 1
    return group[0][:n]


def test_the_ideal_counts_the_full_pages_shared_with_an_earlier_first_turn() -> None:
    system, other = list(range(100, 140)), list(range(200, 240))  # 40 tokens: 2 full pages
    first = [Turn([*system, 1, 2, 3], 4), Turn([7] * 20, 4)]  # later turns do not count
    conversations = [
        Conversation("a", tuple(first)),
        Conversation("", (Turn([*system, 4, 5], 4),)),  # 32 from the first
        Conversation("", (Turn([*other, 6], 4),)),  # new
        Conversation("", (Turn([*system, 1, 2, 3], 4),)),  # 32 (its tail page is not full)
        Conversation("", (Turn([*system[:16]], 4),)),  # the last token never counts: 0
    ]
    assert ideal_cached_tokens(conversations, 16) == 64
    assert ideal_cached_tokens(conversations, 8) == 40 + 40 + 8


def test_the_shared_prefix_ideal_is_each_system_prompts_pages_after_its_first_use() -> None:
    conversations = make_conversations(load_workload("shared-prefix"), 100, seed=0, run=1)
    prompts = [c.turns[0].user for c in conversations]
    systems = system_prompts(prompts)
    firsts: set[tuple[int, ...]] = set()
    expected = 0
    for p in prompts:
        key = tuple(p[:1024])
        if key in firsts:
            expected += len(systems[key]) // 16 * 16
        firsts.add(key)
    assert ideal_cached_tokens(conversations, 16) == expected > 0
    chat = make_conversations(load_workload("chat"), 100, seed=0, run=1)
    assert ideal_cached_tokens(chat, 16) == 0


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
        ({"prompt": GOOD, "output": GOOD, "prefixes": 8}, "prefix"),
        ({"prompt": GOOD, "output": GOOD, "prefix": UNIFORM}, "prefixes"),
        ({"prompt": GOOD, "output": GOOD, "prefix": UNIFORM, "prefixes": 0}, "prefixes"),
        ({"prompt": GOOD, "output": GOOD, "prefix": UNIFORM, "prefixes": 1.0}, "prefixes"),
        ({"prompt": GOOD, "output": GOOD, "prefix": {"dist": "x"}, "prefixes": 2}, "prefix.dist"),
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
