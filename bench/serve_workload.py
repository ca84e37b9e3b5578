"""Serving workloads: a spec file in bench/workloads/ and the conversations it generates.

A spec gives three length distributions: `prompt` (the new user text of each turn, in
tokens), `output` (tokens per reply) and optionally `turns` (per conversation; default 1).
Each is `{dist: lognormal, median, sigma, low, high}` (bench/workload.py's LengthDist:
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

from bench.workload import LengthDist, random_prompt
from cluster.config import ConfigError

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
    """A spec by name (bench/workloads/NAME.yaml) or by path to a YAML file."""
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
    unknown = sorted(set(doc) - {"prompt", "output", "turns"})
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown field (known: output, prompt, turns)")
    for field in ("prompt", "output"):
        if field not in doc:
            raise ConfigError(f"{field}: missing")
    turns = _dist(doc["turns"], "turns") if "turns" in doc else ONE_TURN
    return WorkloadSpec(name, _dist(doc["prompt"], "prompt"), _dist(doc["output"], "output"), turns)


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
    """doc[key], checked: a number (an int if `integer`; never a bool) for which ok() holds."""
    if key not in doc:
        raise ConfigError(f"{field}.{key}: missing")
    value = doc[key]
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds) or not ok(value):
        raise ConfigError(f"{field}.{key}: must be {must}, got {value!r}")
    return value


def make_conversations(
    spec: WorkloadSpec, n: int, seed: int, run: int = 0, vocab_size: int = VOCAB_SIZE
) -> list[Conversation]:
    """n conversations; lengths from `seed` alone, token ids from `seed` and `run`."""
    rng = np.random.default_rng(seed)
    turns = spec.turns.draw(rng, n)
    prompt_lens = iter(spec.prompt.draw(rng, sum(turns)))
    output_lens = iter(spec.output.draw(rng, sum(turns)))
    ids = np.random.default_rng([seed, run])
    return [
        Conversation(
            f"bench-{seed}-{run}-{i}" if spec.multi_turn else "",
            tuple(
                Turn(random_prompt(ids, next(prompt_lens), vocab_size), next(output_lens))
                for _ in range(k)
            ),
        )
        for i, k in enumerate(turns)
    ]
