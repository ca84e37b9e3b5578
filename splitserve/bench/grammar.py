"""`splitserve bench grammar`: what holding a batch's output to a grammar costs per token,
xgrammar against llguidance, on the bundled model's tokenizer (49,152 tokens).

For each engine and batch size (1 and 64 rows, each row its own matcher on the same JSON
schema), walk a valid reply token by token: per step, fill every row's bitmask (fill),
apply the masks to a [rows, vocab] float32 logits tensor (apply), and advance every
matcher by the token. Figures are milliseconds per step, medians of the steps after a
warm-up step; the one-time cost of compiling the schema is shown beside them.
llguidance is an optional peer (`pip install llguidance`); without it only xgrammar runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from cluster.engine.grammar import apply_bitmask
from cluster.engine.model.model_files import bundled_model_path
from cluster.engine.model.tokenizer import Tokenizer
from splitserve.hardware import host_line

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}}}}  # fmt: skip
REPLY = {"name": "Ada Lovelace", "age": 36, "tags": ["a", "b", "b", "a"]}
BATCHES = (1, 64)

# An engine: (build one matcher, fill row i of a bitmask, apply, advance) given the vocab.
Engine = tuple[Callable[[], Any], Callable[[Any, Any, int], None], Callable[..., None],
               Callable[[Any, int], bool], Callable[[int], Any]]  # fmt: skip


def xgrammar_engine(tok: Tokenizer, vocab: int, apply: Callable[..., None] | None = None
                    ) -> tuple[Engine, float]:  # fmt: skip
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=vocab)
    grammar = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA))
    compiled = time.perf_counter() - started
    return (
        lambda: xgr.GrammarMatcher(grammar),
        lambda m, bitmask, i: m.fill_next_token_bitmask(bitmask, i),
        apply or xgr.apply_token_bitmask_inplace,
        lambda m, t: m.accept_token(t),
        lambda rows: xgr.allocate_token_bitmask(rows, vocab),
    ), compiled


def llguidance_engine(tok: Tokenizer, vocab: int) -> tuple[Engine, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    started = time.perf_counter()
    tokenizer = llguidance.hf.from_tokenizer(tok.hf, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    compiled = time.perf_counter() - started
    return (
        lambda: llguidance.LLMatcher(tokenizer, grammar),
        lambda m, bitmask, i: lt.fill_next_token_bitmask(m, bitmask, i),
        lt.apply_token_bitmask_inplace,
        lambda m, t: m.consume_token(t),
        lambda rows: lt.allocate_token_bitmask(rows, vocab),
    ), compiled


def per_step(engine: Engine, rows: int, ids: list[int], vocab: int) -> tuple[float, float]:
    """Median milliseconds per step to fill the rows' masks, and to apply them."""
    new, fill, apply, advance, allocate = engine
    matchers = [new() for _ in range(rows)]
    bitmask, logits = allocate(rows), torch.randn(rows, vocab)
    fills, applies = [], []
    for token in ids:
        started = time.perf_counter()
        for i, m in enumerate(matchers):
            fill(m, bitmask, i)
        filled = time.perf_counter()
        apply(logits, bitmask)
        fills.append(filled - started)
        applies.append(time.perf_counter() - filled)
        for m in matchers:
            if not advance(m, token):
                raise RuntimeError(f"token {token} refused: the reply does not fit the schema")
    return statistics.median(fills[1:]) * 1e3, statistics.median(applies[1:]) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench grammar", description=__doc__)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = Tokenizer.load(bundled_model_path())
    vocab = 49152
    ids = tok.encode(json.dumps(REPLY), special_tokens=False)
    print(host_line())
    print(f"JSON schema reply of {len(ids)} tokens; ms per step (median), fill + apply")
    print("| engine | compile ms | rows | fill ms | apply ms | total ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    engines: list[tuple[str, Callable[[Tokenizer, int], tuple[Engine, float]]]] = [
        ("xgrammar", xgrammar_engine),
        ("xgrammar, our apply (served)", lambda t, v: xgrammar_engine(t, v, apply_bitmask)),
        ("llguidance", llguidance_engine),
    ]
    for name, build in engines:
        try:
            engine, compiled = build(tok, vocab)
        except ImportError:
            print(f"| {name} | not installed | | | | |")
            continue
        for rows in BATCHES:
            fill, apply = per_step(engine, rows, ids, vocab)
            print(f"| {name} | {compiled * 1e3:.0f} | {rows} | {fill:.3f} | {apply:.3f} | "
                  f"{fill + apply:.3f} |")  # fmt: skip
    return 0
