"""Serving workloads: a spec file in splitserve/workloads/ and the conversations it generates.

A spec gives three length distributions: `prompt` (the new user text of each turn, in
tokens), `output` (tokens per reply) and optionally `turns` (per conversation; default 1).
With `prefixes: N` and a `prefix` length distribution, N system prompts are drawn and
each conversation's first turn starts with one of them, picked at random (SGLang's
generated-shared-prefix benchmark): `ideal_cached_tokens` says how many prompt tokens a
prefix cache could serve at best.
Each is `{dist: lognormal, median, sigma, low, high}` (splitserve/workload.py's LengthDist:
rounded, clipped to [low, high]) or `{dist: uniform, low, high}` (integers, both ends
included). Prompts are random vocabulary ids, so lengths are exact; replies are meant to
run with ignore_eos and max_tokens = the output length, so they are exact too.

A conversation's turns are sent one after another: each turn's prompt is the previous
turn's prompt, its reply, then the new user text; conversations of a multi-turn spec carry
a session id. Lengths depend on the seed alone, so every run of a sweep gets the same
lengths; token ids also depend on the run, so that no run reuses another's prompts through
the server's prefix cache. Two invocations with the same seed do share prompts: against the
same server, the summary's cached_prompt_tokens shows it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from cluster.config import ConfigError
from cluster.engine.sched.page_pool import hash_pages
from cluster.types import BlockHash
from splitserve.workload import LengthDist, random_prompt

WORKLOADS = Path(__file__).parent / "workloads"
VOCAB_SIZE = 49152  # the bundled SmolLM2's


@dataclass(frozen=True)
class UniformDist:
    """Integers in [low, high], each equally likely."""

    low: int
    high: int

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(v) for v in rng.integers(self.low, self.high + 1, n)]


Dist = LengthDist | UniformDist
ONE_TURN = UniformDist(1, 1)
FIELDS = {"lognormal": ("median", "sigma", "low", "high"), "uniform": ("low", "high")}


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    prompt: Dist
    output: Dist
    turns: Dist = ONE_TURN
    prefixes: int = 0  # system prompts shared by the conversations (0: none)
    prefix: Dist | None = None  # ... their lengths

    @property
    def multi_turn(self) -> bool:
        return self.turns.high > 1


@dataclass(frozen=True)
class Turn:
    user: list[int]  # the new user text's token ids
    output_len: int


@dataclass(frozen=True)
class Conversation:
    session_id: str  # "" when the spec is one-turn
    turns: tuple[Turn, ...]


def load_workload(name: str) -> WorkloadSpec:
    """A spec by name (splitserve/workloads/NAME.yaml) or by path to a YAML file."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else WORKLOADS / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in WORKLOADS.glob("*.yaml"))
        raise ConfigError(f"workload {name}: not found (known: {known}, or a .yaml path)")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"workload {path}: not valid YAML: {e}") from None
    try:
        return workload_from_dict(path.stem, doc)
    except ConfigError as e:
        raise ConfigError(f"workload {path}: {e}") from None


def workload_from_dict(name: str, doc: Any) -> WorkloadSpec:
    """Check a spec's plain data field by field; errors name the field."""
    if not isinstance(doc, dict):
        raise ConfigError("top level: must be a mapping")
    known = ("output", "prefix", "prefixes", "prompt", "turns")
    unknown = sorted(set(doc) - set(known))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown field (known: {', '.join(known)})")
    for field in ("prompt", "output"):
        if field not in doc:
            raise ConfigError(f"{field}: missing")
    if ("prefix" in doc) != ("prefixes" in doc):
        raise ConfigError(f"{'prefixes' if 'prefix' in doc else 'prefix'}: missing (both or none)")
    turns = _dist(doc["turns"], "turns") if "turns" in doc else ONE_TURN
    prompt, output = _dist(doc["prompt"], "prompt"), _dist(doc["output"], "output")
    if "prefixes" not in doc:
        return WorkloadSpec(name, prompt, output, turns)
    prefixes = _number(doc, "prefixes", "prefixes", lambda v: v >= 1, "an integer >= 1", True)
    return WorkloadSpec(name, prompt, output, turns, prefixes, _dist(doc["prefix"], "prefix"))


def _dist(doc: Any, field: str) -> Dist:
    if not isinstance(doc, dict):
        raise ConfigError(f"{field}: must be a mapping with dist: lognormal or uniform")
    kind = doc.get("dist")
    if not isinstance(kind, str) or kind not in FIELDS:
        raise ConfigError(f"{field}.dist: must be lognormal or uniform, got {kind!r}")
    unknown = sorted(set(doc) - {"dist", *FIELDS[kind]})
    if unknown:
        raise ConfigError(f"{field}.{unknown[0]}: unknown for {kind} (known: {FIELDS[kind]})")
    low = _number(doc, field, "low", lambda v: v >= 1, "an integer >= 1", integer=True)
    high = _number(
        doc, field, "high", lambda v: v >= low, f"an integer >= low ({low})", integer=True
    )
    if kind == "uniform":
        return UniformDist(low, high)
    median = _number(doc, field, "median", lambda v: v > 0, "a number > 0")
    sigma = _number(doc, field, "sigma", lambda v: v >= 0, "a number >= 0")
    return LengthDist(float(median), float(sigma), low, high)


def _number(
    doc: dict[str, Any],
    field: str,
    key: str,
    ok: Callable[[Any], bool],
    must: str,
    integer: bool = False,
) -> Any:
    """doc[key], checked: a number (an int if `integer`; never a bool) for which ok() holds.
    Errors name `field.key`, or `key` alone when it is the field."""
    name = key if key == field else f"{field}.{key}"
    if key not in doc:
        raise ConfigError(f"{name}: missing")
    value = doc[key]
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds) or not ok(value):
        raise ConfigError(f"{name}: must be {must}, got {value!r}")
    return value


def make_conversations(
    spec: WorkloadSpec, n: int, seed: int, run: int = 0, vocab_size: int = VOCAB_SIZE
) -> list[Conversation]:
    """n conversations; lengths (and which system prompt each starts with) from `seed`
    alone, token ids from `seed` and `run`."""
    rng = np.random.default_rng(seed)
    turns = spec.turns.draw(rng, n)
    prompt_lens = iter(spec.prompt.draw(rng, sum(turns)))
    output_lens = iter(spec.output.draw(rng, sum(turns)))
    ids = np.random.default_rng([seed, run])
    starts = _system_prompts(spec, n, rng, ids, vocab_size)
    return [
        Conversation(
            f"bench-{seed}-{run}-{i}" if spec.multi_turn else "",
            tuple(
                Turn(
                    (start if t == 0 else []) + random_prompt(ids, next(prompt_lens), vocab_size),
                    next(output_lens),
                )
                for t in range(k)
            ),
        )
        for i, (k, start) in enumerate(zip(turns, starts, strict=True))
    ]


def _system_prompts(
    spec: WorkloadSpec, n: int, rng: np.random.Generator, ids: np.random.Generator, vocab_size: int
) -> list[list[int]]:
    """The system prompt each of n conversations starts with (empty without `prefixes`)."""
    if spec.prefix is None:
        return [[] for _ in range(n)]
    prompts = [random_prompt(ids, k, vocab_size) for k in spec.prefix.draw(rng, spec.prefixes)]
    return [prompts[int(g)] for g in rng.integers(0, spec.prefixes, n)]


def ideal_cached_tokens(conversations: list[Conversation], page_size: int) -> int:
    """First-turn prompt tokens a prefix cache could serve at best: the leading full pages
    each shares with an earlier conversation's first turn (sent in order, every request on
    a worker holding them, no eviction; pages as the engine hashes them). Later turns are
    left out: their prompts hold replies, which the workload does not know."""
    seen: set[BlockHash] = set()
    hits = 0
    for c in conversations:
        chain = hash_pages(c.turns[0].user[:-1], page_size)
        hits += page_size * next((i for i, h in enumerate(chain) if h not in seen), len(chain))
        seen.update(chain)
    return hits
